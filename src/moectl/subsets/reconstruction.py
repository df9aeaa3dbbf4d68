"""Reconstruction-loss selection (Lu et al.; TE-MoE §5 and A2).

Keep the set S of k experts minimising ‖F'(X, S) − F(X)‖²_F over the calibration block inputs X,
where F'(·, S) masks the experts outside S and re-routes with softmax over the allowed experts
(``renorm="pruned"``). Exhaustive over all C(N, k) sets when that is at most ``exhaustive_limit``
(Lu et al., N = 8); otherwise greedy forward selection (TE-MoE A2): from the empty set, add the
expert giving the lowest loss, k times. While |S| < top-k each token uses all of S. Shared
experts cancel from the difference. Grouped routers: only group-balanced sets are considered.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor

from moectl.adapters.inspect import MoELayer
from moectl.subsets.experts import routed_output, router_logits, select
from moectl.subsets.scores import check_k


@torch.no_grad()
def subset_loss(layer: MoELayer, x: Tensor, logits: Tensor, target: Tensor, subset: list[int]) -> float:
    """‖F'(X, S) − F(X)‖²_F with the routed part of the full layer's output as ``target``."""
    allowed = torch.zeros(layer.num_experts, dtype=torch.bool)
    allowed[subset] = True
    weights, idx = select(layer, logits, allowed)
    return float((routed_output(layer, x, weights, idx) - target).double().pow(2).sum())


@torch.no_grad()
def reconstruction_keep(
    layer: MoELayer, x: Tensor, k: int, exhaustive_limit: int = 5000
) -> tuple[list[int], float]:
    """Return (kept experts sorted by id, their reconstruction loss)."""
    check_k(layer, k)
    logits = router_logits(layer, x)
    target = routed_output(layer, x, *select(layer, logits))
    n, groups = layer.num_experts, layer.rule.n_group
    size, per_group = n // groups, k // groups

    def balanced(subset: list[int], full: bool) -> bool:
        counts = [sum(1 for e in subset if e // size == g) for g in range(groups)]
        return all(c == per_group for c in counts) if full else all(c <= per_group for c in counts)

    if math.comb(n, k) <= exhaustive_limit:
        best: tuple[float, list[int]] | None = None
        for combo in itertools.combinations(range(n), k):
            subset = list(combo)
            if groups > 1 and not balanced(subset, full=True):
                continue
            loss = subset_loss(layer, x, logits, target, subset)
            if best is None or loss < best[0]:
                best = (loss, subset)
        assert best is not None
        return best[1], best[0]
    chosen: list[int] = []
    loss = math.inf
    for _ in range(k):
        step: tuple[float, int] | None = None
        for e in range(n):
            if e in chosen or (groups > 1 and not balanced([*chosen, e], full=False)):
                continue
            trial = subset_loss(layer, x, logits, target, [*chosen, e])
            if step is None or trial < step[0]:
                step = (trial, e)
        assert step is not None
        loss, best_e = step
        chosen.append(best_e)
    return sorted(chosen), loss
