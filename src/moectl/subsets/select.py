"""``select_subset``: run a selection method on a calibration set; per-layer kept-expert lists.

The calibration texts run in batches of ``batch_size`` rows and only the method's statistic is
kept (``stats.py``: running sums; for reconstruction a sample of at most ``max_tokens`` block
inputs per layer). ``layerwise=True`` selects layer by layer: layer l+1's statistics are
measured with layers 0..l already restricted to their kept experts (``ExpertMask``,
``renorm="pruned"``, what slicing gives). Otherwise every layer is measured on the full model
in one pass over the calibration set.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo, MoELayer, inspect
from moectl.errors import ConfigError
from moectl.progress import progress_bar
from moectl.subsets import methods
from moectl.subsets.calibrate import LayerInputs, collect
from moectl.subsets.reconstruction import reconstruction_keep
from moectl.subsets.scores import check_k, top_experts
from moectl.subsets.stats import NEEDS, LayerStats, scores_of

MAX_TOKENS = 4096  # reconstruction's token sample per layer

METHODS = ("router", "frequency", "easy_ep", "reap", "reconstruction", "wanda", "random")

_SCORERS: dict[str, Callable[[MoELayer, Tensor], Tensor]] = {
    "router": methods.router_scores,
    "frequency": methods.frequency_scores,
    "wanda": methods.wanda_scores,
    "reap": methods.reap_scores,
}


def method_name(name: str) -> str:
    """Canonical method name (``easy-ep`` → ``easy_ep``); ValueError listing the choices."""
    canonical = name.strip().lower().replace("-", "_")
    if canonical not in METHODS:
        raise ConfigError(f"unknown selection method {name!r}; choose one of: {', '.join(METHODS)}")
    return canonical


def keep_for_layer(layer: MoELayer, inputs: LayerInputs, k: int, method: str, seed: int = 0) -> list[int]:
    """The ``k`` experts ``method`` keeps in ``layer`` given its calibration inputs."""
    method = method_name(method)
    x = inputs.x
    if method == "easy_ep":
        return top_experts(layer, methods.easy_ep_scores(layer, x, inputs.residual), k)
    if method == "reconstruction":
        return reconstruction_keep(layer, x, k)[0]
    if method == "random":
        return top_experts(layer, methods.random_scores(layer, x, seed), k)
    return top_experts(layer, _SCORERS[method](layer, x), k)


def keep_from_stats(layer: MoELayer, stats: LayerStats, k: int, method: str, seed: int = 0) -> list[int]:
    """The ``k`` experts ``method`` keeps in ``layer`` given its streamed calibration statistics."""
    method = method_name(method)
    if method == "reconstruction":
        assert stats.sample is not None and stats.sample.x is not None
        return reconstruction_keep(layer, stats.sample.x.float(), k)[0]
    return top_experts(layer, scores_of(layer, stats, method, seed), k)


@torch.no_grad()
def select_subset(
    model: nn.Module,
    input_ids: Tensor,
    k: int,
    method: str = "router",
    attention_mask: Tensor | None = None,
    layerwise: bool = False,
    seed: int = 0,
    info: ModelInfo | None = None,
    batch_size: int = 8,
    max_tokens: int | None = MAX_TOKENS,
    progress: bool = False,
) -> dict[int, list[int]]:
    """Select ``k`` experts per MoE layer from calibration tokens; ``{moe_layer: sorted ids}``.
    ``progress``: a bar over the calibration forwards (one pass, or one per MoE layer ``layerwise``)."""
    info = info or inspect(model)
    method = method_name(method)
    for layer in info.layers:
        check_k(layer, k)
    if attention_mask is not None and not bool(attention_mask.bool().any()):
        raise ConfigError("the calibration batch has no real tokens (attention_mask is all zero)")
    needs = NEEDS[method]
    passes = info.num_moe_layers if layerwise else 1
    with progress_bar(f"selecting ({method})", progress) as bar:
        task = bar.add_task(method, total=input_ids.shape[0] * passes)
        options = {"batch_size": batch_size, "max_tokens": max_tokens, "seed": seed,
                   "advance": lambda rows: bar.advance(task, rows)}  # fmt: skip
        keep: dict[int, list[int]] = {}
        if not layerwise:
            stats = collect(model, info, input_ids, attention_mask, needs, **options)
            return {
                layer.index: keep_from_stats(layer, stats[layer.index], k, method, seed) for layer in info.layers
            }
        for layer in info.layers:  # layer l+1 measured with layers 0..l pruned: one pass per layer
            stats = collect(model, info, input_ids, attention_mask, needs, keep, [layer.index], **options)
            keep[layer.index] = keep_from_stats(layer, stats[layer.index], k, method, seed)
        return keep
