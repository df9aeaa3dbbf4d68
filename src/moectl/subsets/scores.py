"""Turn per-expert scores into a kept-expert list: top-k, ties to the lower id, group-balanced.

Grouped routers (DeepSeek-V3, GLM4-MoE, dots1) keep the same number of experts in every group,
at least two (``slicing.check_keep``): the top k/n_group of each group.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moectl.adapters.inspect import MoELayer
from moectl.errors import ConfigError


def check_k(layer: MoELayer, k: int) -> None:
    """Refuse a subset size the layer cannot keep, naming the constraint."""
    if not layer.top_k <= k <= layer.num_experts:
        raise ConfigError(
            f"MoE layer {layer.index}: cannot keep {k} experts; choose top-k = {layer.top_k} <= k <= "
            f"{layer.num_experts} experts"
        )
    groups = layer.rule.n_group
    if groups > 1 and (k % groups or k // groups < 2):
        raise ConfigError(
            f"MoE layer {layer.index}: the router has {groups} expert groups; k must be a multiple of "
            f"{groups} with at least 2 experts per group, got k = {k}"
        )


def top_experts(layer: MoELayer, scores: Tensor, k: int) -> list[int]:
    """The ``k`` best experts by ``scores`` [E] (higher is better), sorted by id."""
    check_k(layer, k)
    scores = scores.detach().double().cpu()
    groups = layer.rule.n_group
    size = layer.num_experts // groups
    kept: list[int] = []
    for g in range(groups):
        part = scores[g * size : (g + 1) * size]
        order = torch.sort(-part, stable=True).indices[: k // groups]
        kept += [g * size + int(i) for i in order]
    return sorted(kept)
