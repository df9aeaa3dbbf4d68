"""Forcing and omitting experts per MoE layer: ``{"type": "experts", "force": {...}, "omit": {...}}``.

What llama.cpp's ``--force-experts`` / ``--omit-experts`` and vLLM's per-request routing maps ask
for, as a routing policy: at each listed MoE layer the ``omit`` experts are never chosen (an
allowed-mask, renormalised as the family's rule does under ``renorm``: ``pruned`` by default, as an
expert mask) and the ``force`` experts are always among the chosen, the rest of the top-k chosen
by the router as usual. Weights stay the family's rule: a forced expert is weighted by its own
router probability (renormalised with the others where the family renormalises), not set to a
constant. Deviation from llama.cpp, whose forced experts replace the router's choice outright:
here the router still picks the remaining slots, so forcing fewer than top-k experts keeps the
model's own routing for the rest.

    {"type": "experts", "force": {"0": [3]}, "omit": {"1": [0, 1]}}

Checked against the model when bound: expert ids in range, a layer's forced experts at most top-k
and not omitted, and at least top-k experts left after the omissions (grouped routers included).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo
from moectl.adapters.rules import Renorm
from moectl.errors import ConfigError
from moectl.routing.policy_config import PolicyConfig, layer_key, register_policy
from moectl.routing.routing_state import RoutingState, RowEffect

_RENORMS = ("pruned", "stock")


def _lists(value: Any, what: str) -> dict[int, list[int]]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"'{what}' must map MoE layer indices to lists of expert ids, got {type(value).__name__}")
    out: dict[int, list[int]] = {}
    for key, ids in value.items():
        layer = layer_key(key, what)
        if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ConfigError(f"'{what}' of MoE layer {layer} must be a list of integer expert ids, got {ids!r}")
        if len(set(ids)) != len(ids):
            raise ConfigError(f"'{what}' of MoE layer {layer} lists an expert twice: {list(ids)}")
        out[layer] = [int(i) for i in ids]
    return out


@register_policy("experts")
@dataclass
class ForceOmit(PolicyConfig):
    """Experts forced into and omitted from the choice, per MoE layer (see the module doc)."""

    force: dict[int, list[int]] = field(default_factory=dict)
    omit: dict[int, list[int]] = field(default_factory=dict)
    renorm: Renorm = "pruned"
    _forced: dict[int, Tensor] = field(default_factory=dict, repr=False)
    _allowed: dict[int, Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.renorm not in _RENORMS:
            raise ConfigError(f"renorm must be one of {_RENORMS}, got {self.renorm!r}")
        self.force = _lists(self.force, "force")
        self.omit = _lists(self.omit, "omit")
        if not self.force and not self.omit:
            raise ConfigError("an 'experts' policy needs 'force' or 'omit' ({layer: [expert ids]})")

    def config_fields(self) -> dict[str, Any]:
        return {
            "force": {str(k): v for k, v in sorted(self.force.items())},
            "omit": {str(k): v for k, v in sorted(self.omit.items())},
            "renorm": self.renorm,
        }

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], info: ModelInfo | None = None, *, model: nn.Module | None = None
    ) -> ForceOmit:
        unknown = sorted(set(data) - {"type", "format_version", "force", "omit", "renorm"})
        if unknown:
            raise ConfigError(f"an 'experts' policy has no field {unknown[0]!r}; its fields: force, omit, renorm")
        policy = cls(data.get("force") or {}, data.get("omit") or {}, data.get("renorm", "pruned"))
        if info is not None:
            policy.bind(info)
        return policy

    def bind(self, info: ModelInfo) -> None:
        self._forced, self._allowed = {}, {}
        layers = info.num_moe_layers
        for what, lists in (("force", self.force), ("omit", self.omit)):
            for layer, ids in lists.items():
                if not 0 <= layer < layers:
                    raise ConfigError(f"'{what}': MoE layer {layer} is out of range; the model has MoE layers 0..{layers - 1}")
                n = info.layer(layer).num_experts
                bad = next((i for i in ids if not 0 <= i < n), None)
                if bad is not None:
                    raise ConfigError(f"'{what}' of MoE layer {layer}: expert {bad} is out of range; valid ids are 0..{n - 1}")
        for layer, ids in self.force.items():
            rule = info.layer(layer).rule
            if rule.kind == "sparsemixer":
                raise ConfigError("forcing experts is not supported for Phi-MoE's sparsemixer router")
            if len(ids) > rule.top_k:
                raise ConfigError(f"'force' of MoE layer {layer} lists {len(ids)} experts; the layer chooses top-k = {rule.top_k}")
            clash = sorted(set(ids) & set(self.omit.get(layer, [])))
            if clash:
                raise ConfigError(f"MoE layer {layer}: expert {clash[0]} is both forced and omitted")
            mask = torch.zeros(rule.num_experts, dtype=torch.bool)
            mask[ids] = True
            self._forced[layer] = mask
        for layer, ids in self.omit.items():
            rule = info.layer(layer).rule
            mask = torch.ones(rule.num_experts, dtype=torch.bool)
            mask[ids] = False
            rule.check_allowed(mask, where=f"'omit' of MoE layer {layer}")
            self._allowed[layer] = mask

    def row_effect(self, layer: int) -> RowEffect:
        """The same for every token (``RowConstantPolicy``)."""
        return RowEffect(allowed=self._allowed.get(layer), forced=self._forced.get(layer), renorm=self.renorm)

    def apply(self, state: RoutingState) -> None:
        allowed = self._allowed.get(state.layer)
        if allowed is not None:
            state.restrict(allowed.view(1, 1, -1), renorm=self.renorm)
        forced = self._forced.get(state.layer)
        if forced is not None:
            state.force(forced.view(1, 1, -1))
