"""Expert-selection methods: per-layer expert scores from calibration block inputs.

Each scorer takes (layer, x [N, H] block inputs of real tokens) and returns scores [E], higher
meaning "keep" (``scores.top_experts`` turns them into a kept list). Reconstruction is a set
search, not a ranking: ``reconstruction.py``.

- ``router``: mean routing probability p over tokens (EMO §4.2, the paper's default).
- ``frequency``: how often each expert is among the token's top-k (TE-MoE §5).
- ``easy_ep``: Σ_t g_{i,t}·‖E_i(x_t)‖·s_t, s_t = 1 − cos(h_t, h_t + h̄_t), h_t the residual stream
  (Easy-EP, Dong et al.).
- ``reap``: REAP (Lasby et al. 2025, router-weighted expert activation pruning):
  S_j = mean over the tokens x routed to j of g_j(x)·‖E_j(x)‖, g_j(x) the combine weight the model
  applies (0 for an expert no calibration token reaches). Also TE-MoE's ``reap`` baseline.
- ``wanda``: Wanda (structured) per expert, Σ |W|·‖X‖ (TE-MoE §5, Sun et al.).
- ``random``: seeded random scores, one fixed subset per layer (EMO Fig. 4's sanity baseline; TE-MoE's
  random baseline instead redraws the set at every token, which a fixed subset cannot express).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moectl.adapters.inspect import MoELayer
from moectl.errors import ConfigError
from moectl.subsets.experts import expert_output, routed_output, router_logits, select


def router_scores(layer: MoELayer, x: Tensor) -> Tensor:
    """Mean routing probability of every expert over the calibration tokens."""
    return layer.rule.probs(router_logits(layer, x)).mean(0)


def frequency_scores(layer: MoELayer, x: Tensor) -> Tensor:
    """Fraction of calibration tokens that route to each expert (top-k, the model's own rule)."""
    _, idx = select(layer, router_logits(layer, x))
    counts = torch.bincount(idx.reshape(-1).cpu(), minlength=layer.num_experts)
    return counts.double() / x.shape[0]


@torch.no_grad()
def easy_ep_scores(
    layer: MoELayer, x: Tensor, residual: Tensor | None = None, logits: Tensor | None = None
) -> Tensor:
    """Easy-EP: gate × output norm of the activated experts, weighted by the token's contribution.

    g_{i,t} is the combine weight of expert i for token t (0 when not activated) and E_i takes the
    block input x_t. As in the authors' code (RUCAIBox/EASYEP, ``pruning/model_new.py``), h_t is the
    residual stream entering the MoE sublayer (before its norm) and h̄_t the routed experts' output
    Σ_i g_{i,t}·E_i(x_t), shared experts excluded: s_t = max(1 − cos(h_t, h_t + h̄_t), 0).
    ``residual`` defaults to ``x`` (for callers without the residual stream). ``logits`` [N, E]:
    the router's logits for ``x`` when already known (computed from ``x`` otherwise). A sum over
    tokens: the scores of a calibration set are the sums of its batches' scores.
    """
    weights, idx = select(layer, router_logits(layer, x) if logits is None else logits)
    gates = torch.zeros(x.shape[0], layer.num_experts, device=x.device).scatter_(1, idx, weights)
    h_bar = routed_output(layer, x, weights, idx)
    h = x if residual is None else residual
    s = (1 - torch.nn.functional.cosine_similarity(h, h + h_bar, dim=-1)).clamp(min=0)
    scores = torch.zeros(layer.num_experts, dtype=torch.float64)
    for i in range(layer.num_experts):  # one call per expert, vectorised over tokens
        rows = gates[:, i] > 0
        if rows.any():
            norm = expert_output(layer, x[rows], i).norm(dim=-1)
            scores[i] = float((gates[rows, i] * norm * s[rows]).double().sum())
    return scores


@torch.no_grad()
def reap_sums(layer: MoELayer, x: Tensor, logits: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """REAP's per-expert sums over tokens: Σ_{x routed to j} g_j(x)·‖E_j(x)‖ and the number of such
    tokens, both [E] float64 (sums: a calibration set's are its batches' sums)."""
    weights, idx = select(layer, router_logits(layer, x) if logits is None else logits)
    gates = torch.zeros(x.shape[0], layer.num_experts, device=x.device).scatter_(1, idx, weights)
    routed = torch.zeros(x.shape[0], layer.num_experts, dtype=torch.bool, device=x.device)
    routed.scatter_(1, idx, True)
    sums = torch.zeros(layer.num_experts, dtype=torch.float64)
    for i in range(layer.num_experts):  # one call per expert, vectorised over its tokens
        rows = routed[:, i]
        if rows.any():
            norm = expert_output(layer, x[rows], i).norm(dim=-1)
            sums[i] = float((gates[rows, i] * norm).double().sum())
    return sums, routed.sum(0).double().cpu()


def reap_scores(layer: MoELayer, x: Tensor) -> Tensor:
    """REAP: the router-weighted mean expert output norm over the tokens routed to each expert."""
    sums, counts = reap_sums(layer, x)
    return reap_from_sums(sums, counts)


def reap_from_sums(sums: Tensor, counts: Tensor) -> Tensor:
    """REAP's means from its sums (0 where no token was routed)."""
    return torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))


@torch.no_grad()
def wanda_scores(layer: MoELayer, x: Tensor) -> Tensor:
    """Wanda (structured) per expert: Σ_{j,c} |W_{j,c}|·‖X_c‖₂ over the expert's input projection.

    ‖X_c‖₂ is the norm of input channel c over all calibration tokens (the input every expert
    receives). Only the input-side (gate/up) weights are scored: the down projection's inputs are
    each expert's intermediate activations, which the fused experts module does not expose.
    """
    return wanda_from_norms(layer, x.double().norm(dim=0))


@torch.no_grad()
def wanda_from_norms(layer: MoELayer, norms: Tensor) -> Tensor:
    """Wanda (structured) per expert from the input-channel norms ‖X_c‖₂ [H] (float64)."""
    hidden = norms.shape[-1]
    weight = _input_projection(layer, hidden).detach()
    # [E, H, 2I]: computed as x @ W (gpt-oss, Llama 4); [E, 2I, H]: F.linear(x, W)
    channel = norms[:, None] if _transposed(layer) else norms
    scores = torch.empty(weight.shape[0], dtype=torch.float64)
    for e in range(weight.shape[0]):  # one expert's float64 copy at a time, not the layer's
        scores[e] = (weight[e].double().abs() * channel).sum()
    return scores


def random_scores(layer: MoELayer, x: Tensor, seed: int = 0) -> Tensor:
    """Seeded random scores (per layer: the seed is offset by the layer index)."""
    generator = torch.Generator().manual_seed(seed * 100_003 + layer.index)
    return torch.rand(layer.num_experts, generator=generator, dtype=torch.float64)


def _transposed(layer: MoELayer) -> bool:
    experts = layer.block.experts
    return bool(getattr(experts, "is_transposed", layer.adapter.experts_transposed))


def _input_projection(layer: MoELayer, hidden: int) -> Tensor:
    experts = layer.block.experts
    weight = getattr(experts, "gate_up_proj", None)
    if weight is None and isinstance(experts, torch.nn.ModuleList) and hasattr(experts[0], "gate_proj"):
        # one module per expert (remote-code blocks, e.g. EMO): stack the routed experts' [2I, H]
        ids = (
            layer.router.routed_ids(experts[0].gate_proj.weight.device).tolist()
            if hasattr(layer.router, "routed_ids")
            else range(len(experts))
        )
        weight = torch.stack(
            [torch.cat([experts[i].gate_proj.weight, experts[i].up_proj.weight]) for i in ids]
        )
    dim = 1 if _transposed(layer) else 2
    if not isinstance(weight, Tensor) or weight.dim() != 3 or weight.shape[dim] != hidden:
        raise ConfigError(
            f"MoE layer {layer.index}: wanda needs 3-D fused expert weights gate_up_proj [E, ., {hidden}]; "
            f"{type(experts).__name__} has none"
        )
    return weight
