"""``select_subset``: run a selection method on a calibration set; per-layer kept-expert lists.

``layerwise=True`` selects layer by layer: layer l+1's inputs are measured with layers 0..l
already restricted to their kept experts (``ExpertMask``, ``renorm="pruned"``, what slicing
gives). Otherwise every layer is measured on the full model in one forward pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo, MoELayer, inspect
from moectl.subsets import methods
from moectl.subsets.calibrate import LayerInputs, capture
from moectl.subsets.reconstruction import reconstruction_keep
from moectl.subsets.scores import check_k, top_experts

METHODS = ("router", "frequency", "easy_ep", "reconstruction", "wanda", "random")

_SCORERS: dict[str, Callable[[MoELayer, Tensor], Tensor]] = {
    "router": methods.router_scores,
    "frequency": methods.frequency_scores,
    "wanda": methods.wanda_scores,
}


def method_name(name: str) -> str:
    """Canonical method name (``easy-ep`` → ``easy_ep``); ValueError listing the choices."""
    canonical = name.strip().lower().replace("-", "_")
    if canonical not in METHODS:
        raise ValueError(f"unknown selection method {name!r}; choose one of: {', '.join(METHODS)}")
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
) -> dict[int, list[int]]:
    """Select ``k`` experts per MoE layer from calibration tokens; ``{moe_layer: sorted ids}``."""
    info = info or inspect(model)
    method = method_name(method)
    for layer in info.layers:
        check_k(layer, k)
    if attention_mask is not None and not bool(attention_mask.bool().any()):
        raise ValueError("the calibration batch has no real tokens (attention_mask is all zero)")
    keep: dict[int, list[int]] = {}
    if not layerwise:
        inputs = capture(model, info, input_ids, attention_mask)
        for layer in info.layers:
            keep[layer.index] = keep_for_layer(layer, inputs[layer.index], k, method, seed)
        return keep
    for layer in info.layers:
        inputs = capture(model, info, input_ids, attention_mask, keep=keep, layers=[layer.index])
        keep[layer.index] = keep_for_layer(layer, inputs[layer.index], k, method, seed)
    return keep
