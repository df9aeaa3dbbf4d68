"""Effective experts per document, per MoE layer: how many experts a document really uses.

For a document d and MoE layer l, average the routing distribution over d's real tokens::

    p̄_d = (1/|d|) Σ_{t∈d} p_t,        effective experts = exp(H(p̄_d)) = exp(−Σ_e p̄_d,e · log p̄_d,e),

the perplexity of the document's mean routing distribution (the "effective number" of a
distribution: E for a uniform one, n for one uniform over n experts). Two sources of p_t:

- ``"probs"``: the router's probabilities (EMO §5.3's routing distribution); a router that has
  not learned to route is near-uniform and gives ≈ E;
- ``"chosen"``: the experts actually used, 1/k each per token; ≥ k (a document whose tokens all
  use the same k experts gives exactly k), ≤ E.

EMO's document pools make this small (a document keeps to a pool of experts); it is the
per-document figure of ``moectl.subsets.similarity.document_statistics`` (same definition; read
here from one :class:`RoutingTrace`, both sources from one forward pass).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo, inspect
from moectl.errors import ConfigError
from moectl.routing.session import route
from moectl.routing.trace import RoutingTrace

SOURCES = ("probs", "chosen")

__all__ = [
    "SOURCES",
    "document_distributions",
    "effective_experts",
    "effective_number",
    "measure",
    "report",
    "summarise",
]


def effective_number(p: Tensor) -> Tensor:
    """exp(entropy) of the distributions along the last dimension (normalised first; 0·log 0 = 0)."""
    p = p.double()
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-300)
    return torch.exp(-torch.special.xlogy(p, p).sum(-1))


def document_distributions(
    trace: RoutingTrace, source: str = "probs", valid: Tensor | None = None
) -> dict[int, Tensor]:
    """``{moe_layer: [B, E]}``: each row's (document's) routing distribution averaged over its real
    tokens (``valid`` [B, T], default the trace's own: padding excluded)."""
    if source not in SOURCES:
        raise ConfigError(f"source must be one of {', '.join(SOURCES)}, got {source!r}")
    valid = (trace.valid if valid is None else valid).bool()
    if not bool(valid.any(1).all()):
        raise ConfigError("every document needs at least one real token")
    out = {}
    for layer in trace.probs:
        if source == "probs":
            p = trace.probs[layer].double()
        else:
            used = trace.chosen_mask(layer).double()
            p = used / used.sum(-1, keepdim=True).clamp(min=1)
        p = p * valid[..., None]
        out[layer] = p.sum(1) / valid.sum(1, keepdim=True)
    return out


def effective_experts(
    trace: RoutingTrace, source: str = "probs", valid: Tensor | None = None
) -> dict[int, Tensor]:
    """``{moe_layer: [B]}`` effective experts of each document of the trace (see the module docstring)."""
    return {layer: effective_number(p) for layer, p in document_distributions(trace, source, valid).items()}


@torch.no_grad()
def measure(
    model: nn.Module, batches: Iterable[Mapping[str, Tensor]], info: ModelInfo | None = None
) -> dict[str, dict[int, Tensor]]:
    """``{source: {moe_layer: [documents]}}`` over ``batches`` of ``{"input_ids", "attention_mask"}``
    (one document per row; padding marked 0 in the mask), both sources from one forward per batch.
    Memory: one batch's forward and its routing trace."""
    info = info or inspect(model)
    device = next(model.parameters()).device
    parts: dict[str, dict[int, list[Tensor]]] = {
        s: {layer.index: [] for layer in info.layers} for s in SOURCES
    }
    for batch in batches:
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        with route(model, [], record=True, info=info) as session:
            model(input_ids=ids, attention_mask=mask)
        for source in SOURCES:
            for layer, values in effective_experts(session.trace, source, mask.cpu()).items():
                parts[source][layer].append(values)
    return {s: {layer: torch.cat(v) for layer, v in per.items()} for s, per in parts.items()}


def summarise(values: Mapping[int, Tensor]) -> dict[int, dict[str, float]]:
    """Per layer: mean, median, min and max over documents, and the number of documents."""
    out = {}
    for layer, v in values.items():
        v = v.double()
        out[layer] = {
            "mean": float(v.mean()),
            "median": float(v.median()),
            "min": float(v.min()),
            "max": float(v.max()),
            "documents": int(v.numel()),
        }
    return out


def report(
    values: Mapping[str, Mapping[int, Tensor]],
    info: ModelInfo,
    model: str = "",
    interval: Callable[[Tensor], tuple[float, float]] | None = None,
) -> dict:
    """One model's result as ``benchmarks/effective_experts.py --json`` writes it and ``moectl card``
    reads it: per MoE layer (string keys) and source, :func:`summarise`'s figures plus ``ci95`` from
    ``interval`` (e.g. ``moectl.eval.intervals.mean_interval``; None: no interval), the mean over
    layers per source, and every document's value."""
    layers: dict[str, dict] = {}
    for source in SOURCES:
        for layer, row in summarise(values[source]).items():
            ci = list(interval(values[source][layer])) if interval is not None else None
            layers.setdefault(str(layer), {})[source] = {**row, "ci95": ci}
    return {
        "model": model,
        "num_experts": info.num_experts,
        "top_k": info.top_k,
        "moe_layers": [layer.layer_idx for layer in info.layers],
        "layers": layers,
        "mean_over_layers": {s: sum(v[s]["mean"] for v in layers.values()) / len(layers) for s in SOURCES},
        "per_document": {s: {str(k): v.tolist() for k, v in values[s].items()} for s in SOURCES},
    }
