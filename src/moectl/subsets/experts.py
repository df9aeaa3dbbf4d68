"""One MoE layer as functions of its input: router logits, routing, per-expert and routed outputs.

Every family except Llama 4 calls its experts module as ``experts(x, top_k_index, top_k_weights)``
and returns Σ_i w_i·E_i(x); Llama 4 scales the input instead (Σ_i E_i(w_i·x)), with the experts
module taking a dense [E·N, H] input. Shared experts are left out: they are the same in the full
and the pruned layer, so they cancel from every difference the selection methods take.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from moectl.adapters.inspect import MoELayer
from moectl.adapters.linear_gate import GateRouter


def router_logits(layer: MoELayer, x: Tensor) -> Tensor:
    """Raw router logits [N, E] float32 for block inputs ``x`` [N, H]."""
    out = layer.router(x.to(_dtype(layer)))
    return layer.adapter.logits_of(out).reshape(x.shape[0], -1).float()


def select(layer: MoELayer, logits: Tensor, allowed: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The family's routing (weights [N, k], indices [N, k]) restricted to ``allowed`` [E] experts.

    Softmax over the allowed experts (``renorm="pruned"``, what slicing gives). When fewer than
    top-k experts are allowed (greedy selection's first steps), each token uses all of them.
    """
    rule = layer.rule
    if allowed is not None:
        rule = dataclasses.replace(rule, top_k=min(rule.top_k, int(allowed.sum())))
        allowed = allowed.reshape(1, -1).to(logits.device)
    return rule.select(logits, layer.adapter.bias(layer.router), allowed, None, "pruned")


def routed_output(layer: MoELayer, x: Tensor, weights: Tensor, idx: Tensor) -> Tensor:
    """Σ over the chosen experts of their weighted outputs, [N, H] float32 (no shared experts)."""
    experts, dtype = layer.block.experts, _dtype(layer)
    if isinstance(layer.router, GateRouter):  # a bare-Linear gate (remote-code blocks, e.g. EMO)
        return layer.router.routed_output(x.to(dtype), weights.to(dtype), idx).float()
    return layer.adapter.routed_output(experts, x, weights, idx, dtype)


def expert_output(layer: MoELayer, x: Tensor, expert: int) -> Tensor:
    """E_i(x) [N, H] float32: expert ``expert`` alone with weight 1 on every token."""
    n = x.shape[0]
    idx = torch.full((n, 1), expert, dtype=torch.long, device=x.device)
    return routed_output(layer, x, torch.ones(n, 1, device=x.device), idx)


def _dtype(layer: MoELayer) -> torch.dtype:
    return next(layer.block.parameters()).dtype
