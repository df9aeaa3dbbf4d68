"""``topk:N``: route every token to N experts instead of the model's top-k.

What llama.cpp #13572 and vLLM #2096 / #17150 ask for, per request: the router's own rule with N in
place of k — softmax top-N for softmax routers, the family's renormalisation where it has one
(``norm_topk_prob``: the N weights renormalised), score-correction bias and expert groups as the
rule applies them — for N below k (fewer experts read per token) and above it (more compute, up to
every expert). It composes with masks, pools and forced experts: they narrow or bias the choice,
N says how many are chosen.

    {"type": "topk", "n": 2}        # or the short form topk:2

Rows of one engine batch may ask for different N: the router chooses each row's own N experts and
the step runs the widest N, the narrower rows' extra slots weighted 0 (the engine's traces and
expert counts keep each row's own N). Refused for routers whose block reads a fixed k itself (Phi-MoE's
sparsemixer, Llama 4's dense scores) and for N outside 1..experts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo
from moectl.adapters.rules import RouterRule
from moectl.errors import ConfigError
from moectl.routing.policy_config import PolicyConfig, register_policy
from moectl.routing.routing_state import RoutingState, RowEffect

_FIXED_K = ("sparsemixer", "sigmoid_dense")


@lru_cache(maxsize=256)
def with_top_k(rule: RouterRule, n: int) -> RouterRule:
    """``rule`` choosing ``n`` experts."""
    from dataclasses import replace

    return rule if rule.top_k == n else replace(rule, top_k=n)


@register_policy("topk")
@dataclass
class TopK(PolicyConfig):
    """N experts per token at every MoE layer (see the module doc)."""

    n: int

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ConfigError(f"topk needs an integer n >= 1 (experts per token), got {self.n!r}")

    def config_fields(self) -> dict[str, Any]:
        return {"n": self.n}

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], info: ModelInfo | None = None, *, model: nn.Module | None = None
    ) -> TopK:
        unknown = sorted(set(data) - {"type", "format_version", "n"})
        if unknown:
            raise ConfigError(f"a 'topk' policy has no field {unknown[0]!r}; its field: n")
        policy = cls(data.get("n"))
        if info is not None:
            policy.bind(info)
        return policy

    def bind(self, info: ModelInfo) -> None:
        for layer in info.layers:
            if layer.rule.kind in _FIXED_K:
                raise ConfigError(
                    f"topk:{self.n}: MoE layer {layer.index}'s router ({layer.rule.kind}) reads a fixed top-k; "
                    "it cannot choose another number of experts"
                )
            if not 1 <= self.n <= layer.num_experts:
                raise ConfigError(
                    f"topk:{self.n}: MoE layer {layer.index} has {layer.num_experts} experts; n must be 1..{layer.num_experts}"
                )

    def row_effect(self, layer: int) -> RowEffect:
        """The same for every token (``RowConstantPolicy``)."""
        return RowEffect(top_k=self.n)

    def apply(self, state: RoutingState) -> None:
        state.top_k = self.n


def select(
    rule: RouterRule,
    state: RoutingState,
    bias: Tensor | None,
    allowed: Tensor | None,
    noise: Tensor | None,
    forced: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """(weights, indices) [B·T, N_max] of one layer's call under ``state``'s numbers of experts:
    ``state.top_k`` (or the rule's) for every row, ``state.row_top_k`` {N: rows} where rows differ;
    a row's slots past its own N repeat its first expert with weight 0. ``allowed`` / ``noise`` /
    ``forced`` are [B·T, E] (or None)."""
    b, t, e = state.logits.shape
    logits = state.logits.reshape(b * t, e)
    default = state.top_k or rule.top_k
    groups = state.row_top_k or {}
    widest = max([default, *groups])

    def one(k: int, flat: Tensor | None) -> tuple[Tensor, Tensor]:
        def cut(x: Tensor | None) -> Tensor | None:
            return x if x is None or flat is None else x[flat]

        chosen_rule = with_top_k(rule, k)
        sub_allowed = cut(allowed)
        if sub_allowed is not None and (state.restrictions > 1 or rule.grouped or k > rule.top_k):
            chosen_rule.check_allowed(sub_allowed, where=f"topk:{k} with the other policies, MoE layer {state.layer}")
        return chosen_rule.select(cut(logits), bias, sub_allowed, cut(noise), state.renorm, cut(forced))

    weights, idx = _pad(*one(default, None), widest)
    for k, rows in groups.items():
        flat = (rows.to(logits.device)[:, None] * t + torch.arange(t, device=logits.device)).reshape(-1)
        w, i = _pad(*one(k, flat), widest)
        weights[flat], idx[flat] = w.to(weights.dtype), i
    return weights, idx


def _pad(weights: Tensor, idx: Tensor, width: int) -> tuple[Tensor, Tensor]:
    extra = width - idx.shape[-1]
    if extra <= 0:
        return weights, idx
    return (
        torch.cat([weights, weights.new_zeros(weights.shape[0], extra)], -1),
        torch.cat([idx, idx[:, :1].expand(-1, extra)], -1),
    )
