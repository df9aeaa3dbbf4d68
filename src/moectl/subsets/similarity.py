"""Domain similarity of expert use (EMO §5.3, Figure 6).

Per domain: average the routing distribution p over each document's real tokens, then over the
domain's documents; cosine similarity between the domain vectors, per MoE layer.
``modularity_report`` is what ``moectl modularity`` prints and saves: the matrices, heatmaps and
each layer's off-diagonal mean / min / max (heatmaps: ``reporting/similarity_plots.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo, inspect
from moectl.errors import ConfigError
from moectl.metrics.effective_experts import effective_number
from moectl.progress import progress_bar
from moectl.routing import route
from moectl.subsets.calibrate import tokenize

SOURCES = ("probs", "chosen")


def document_vectors(
    model: nn.Module, tokenizer, texts: Mapping[str, Sequence[str]], info: ModelInfo | None = None,
    max_length: int = 512, source: str = "probs", batch_size: int = 16, progress: bool = False,
) -> dict[int, list[Tensor]]:  # fmt: skip
    """``{moe_layer: [[docs, E] per domain]}``: each document's mean routing distribution over its tokens.

    ``source="probs"``: the router's probabilities (EMO §5.3); ``"chosen"``: the experts actually
    used, 1/k each per token (what an extracted subset must hold).
    """
    vectors = document_vectors_by_source(
        model, tokenizer, texts, info, max_length, (source,), batch_size, progress
    )
    return vectors[source]


@torch.no_grad()
def document_vectors_by_source(
    model: nn.Module, tokenizer, texts: Mapping[str, Sequence[str]], info: ModelInfo | None = None,
    max_length: int = 512, sources: Sequence[str] = SOURCES, batch_size: int = 16,
    progress: bool = False,
) -> dict[str, dict[int, list[Tensor]]]:  # fmt: skip
    """:func:`document_vectors` for several ``sources`` from one forward pass per batch of
    ``batch_size`` documents: ``{source: {moe_layer: [[docs, E] per domain]}}``."""
    if unknown := [s for s in sources if s not in SOURCES]:
        raise ConfigError(f"source must be 'probs' or 'chosen', got {unknown[0]!r}")
    info = info or inspect(model)
    with progress_bar("routing documents", progress) as bar:
        task = bar.add_task("routing documents", total=sum(len(docs) for docs in texts.values()))
        return _vectors(model, tokenizer, texts, info, max_length, sources, batch_size, lambda n: bar.advance(task, n))


def _vectors(
    model: nn.Module, tokenizer, texts: Mapping[str, Sequence[str]], info: ModelInfo, max_length: int,
    sources: Sequence[str], batch_size: int, advance: Callable[[int], object],
) -> dict[str, dict[int, list[Tensor]]]:  # fmt: skip
    """The forward passes of :func:`document_vectors_by_source`; ``advance(n)`` after each batch."""
    device = next(model.parameters()).device
    out: dict[str, dict[int, list[Tensor]]] = {s: {layer.index: [] for layer in info.layers} for s in sources}
    for docs in texts.values():
        parts: dict[str, dict[int, list[Tensor]]] = {s: {i: [] for i in out[s]} for s in sources}
        for start in range(0, len(docs), batch_size):
            batch = tokenize(tokenizer, docs[start : start + batch_size], max_length)
            ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
            with route(model, [], record=True) as session:
                model(input_ids=ids, attention_mask=mask)
            valid = batch["attention_mask"].bool()
            for source in sources:
                for index in parts[source]:
                    if source == "probs":
                        p = session.trace.probs[index].float().cpu()
                    else:
                        used = session.trace.chosen_mask(index).float().cpu()
                        p = used / used.sum(-1, keepdim=True).clamp(min=1)
                    p = p * valid[..., None]
                    parts[source][index].append(p.sum(1) / valid.sum(1, keepdim=True).clamp(min=1))
            advance(len(ids))
        for source in sources:
            for index, chunks in parts[source].items():
                out[source][index].append(torch.cat(chunks))
    return out


def domain_vectors(
    model: nn.Module, tokenizer, texts: Mapping[str, Sequence[str]], info: ModelInfo | None = None,
    max_length: int = 512, documents: Mapping[int, Sequence[Tensor]] | None = None,
    progress: bool = False,
) -> dict[int, Tensor]:  # fmt: skip
    """``{moe_layer: [D, E]}``: mean over documents of the mean routing distribution over tokens.

    ``documents`` (from :func:`document_vectors`) skips the forward passes.
    """
    documents = documents or document_vectors(model, tokenizer, texts, info, max_length, progress=progress)
    return {index: torch.stack([d.mean(0) for d in per_domain]) for index, per_domain in documents.items()}


def document_statistics(documents: Mapping[int, Sequence[Tensor]]) -> dict[int, dict[str, float]]:
    """Per MoE layer, how concentrated and how domain-specific documents' expert use is.

    ``effective_experts``: mean over documents of exp(entropy) of the document's routing
    distribution (EMO's document pool makes this small); ``within_domain`` / ``across_domains``:
    mean cosine similarity between two different documents of the same / of different domains.
    """
    out = {}
    for index, per_domain in documents.items():
        v = torch.cat(list(per_domain)).double()
        label = torch.cat([torch.full((len(d),), i) for i, d in enumerate(per_domain)])
        unit = F.normalize(v, dim=-1)
        cos = unit @ unit.T
        same = label[:, None] == label[None, :]
        other = ~torch.eye(len(v), dtype=torch.bool)
        out[index] = {
            "effective_experts": float(effective_number(v).mean()),
            "within_domain": float(cos[same & other].mean()),
            "across_domains": float(cos[~same].mean()),
        }
    return out


def domain_similarity(vectors: Mapping[int, Tensor]) -> dict[int, Tensor]:
    """``{moe_layer: [D, D]}`` cosine similarity between the domain vectors."""
    out = {}
    for index, v in vectors.items():
        unit = F.normalize(v.double(), dim=-1)
        out[index] = unit @ unit.T
    return out


def similarity_summary(similarity: Mapping[int, Tensor]) -> dict[int, dict[str, float]]:
    """Per MoE layer, the mean, min and max of the off-diagonal similarities (two domains or more)."""
    out = {}
    for index, matrix in sorted(similarity.items()):
        values = matrix[~torch.eye(len(matrix), dtype=torch.bool)]
        out[index] = {"mean": float(values.mean()), "min": float(values.min()), "max": float(values.max())}
    return out


def modularity_report(
    model: nn.Module, tokenizer, texts: Mapping[str, Sequence[str]], out_dir: str | Path,
    info: ModelInfo | None = None, max_length: int = 512, progress: bool = False,
) -> dict:  # fmt: skip
    """EMO §5.3 (Figure 6) on ``texts`` (two domains or more): the similarity matrices, one heatmap per
    MoE layer in ``out_dir`` and their summaries, keyed by layer as strings (JSON-ready)."""
    similarity = domain_similarity(domain_vectors(model, tokenizer, texts, info, max_length, progress=progress))
    domains = list(texts)
    from moectl.reporting.similarity_plots import plot_similarity  # matplotlib only when plotting

    paths = plot_similarity(similarity, domains, out_dir)
    return {
        "domains": domains,
        "documents": {name: len(docs) for name, docs in texts.items()},
        "similarity": {str(index): matrix.tolist() for index, matrix in similarity.items()},
        "summary": {str(index): values for index, values in similarity_summary(similarity).items()},
        "plots": [str(p) for p in paths],
    }
