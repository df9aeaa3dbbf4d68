"""ExpertMask: a fixed set of allowed experts per MoE layer (TE-MoE §2.2's expert mask ω).

Per layer the mask is ``[E]`` (every token), ``[B, E]`` (per sequence) or ``[B, T, E]`` (per
absolute token position; a decoding step at offset o reads row o). Layers not named allow every
expert. Two renormalisation modes:

- ``"pruned"`` (default): p is renormalised over the allowed experts before the model's own
  top-k rule, i.e. softmax over the allowed logits — exactly what physically removing the other
  experts gives (EMO §3.2's p-hat).
- ``"stock"``: the model's rule on the full p, with top-k restricted to the allowed experts
  (TE-MoE §2.2: "the top-k selection is restricted to the set of allowed experts").

The two coincide for routers that renormalise the k weights without a score-correction bias
(Mixtral, Qwen3-MoE, ...), and for top-k→softmax and sigmoid routers; they differ for routers
without renormalisation (OLMoE, Qwen2-MoE) and for Ernie-4.5, whose bias is added to p.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from moectl.adapters.inspect import ModelInfo
from moectl.adapters.rules import Renorm
from moectl.routing.state import RoutingState

_RENORMS = ("pruned", "stock")


@dataclass
class ExpertMask:
    """Allowed experts per MoE layer: ``{moe_layer_index: bool tensor [E] | [B,E] | [B,T,E]}``."""

    masks: dict[int, Tensor]
    renorm: Renorm = "pruned"
    _bound: dict[int, Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.renorm not in _RENORMS:
            raise ValueError(f"renorm must be one of {_RENORMS}, got {self.renorm!r}")
        clean: dict[int, Tensor] = {}
        for layer, mask in self.masks.items():
            mask = torch.as_tensor(mask)
            if mask.dtype != torch.bool:
                if not bool(((mask == 0) | (mask == 1)).all()):
                    raise ValueError(
                        f"mask of MoE layer {layer} must be boolean or 0/1, got values outside {{0, 1}}"
                    )
                mask = mask.bool()
            if mask.dim() not in (1, 2, 3):
                raise ValueError(
                    f"mask of MoE layer {layer} has shape {tuple(mask.shape)}; allowed shapes are [E], [B, E], [B, T, E]"
                )
            clean[int(layer)] = mask
        self.masks = clean

    @classmethod
    def from_lists(
        cls, info: ModelInfo, experts: Mapping[int, Iterable[int]], renorm: Renorm = "pruned"
    ) -> ExpertMask:
        """Allow the listed experts at each named MoE layer; other layers allow all experts."""
        masks = {}
        for layer, ids in experts.items():
            n = info.layer(int(layer)).num_experts
            ids = [int(i) for i in ids]
            bad = [i for i in ids if not 0 <= i < n]
            if bad:
                raise ValueError(
                    f"MoE layer {layer}: expert ids {bad} out of range; valid ids are 0..{n - 1}"
                )
            if len(set(ids)) != len(ids):
                raise ValueError(f"MoE layer {layer}: duplicate expert ids in {ids}")
            mask = torch.zeros(n, dtype=torch.bool)
            mask[ids] = True
            masks[int(layer)] = mask
        return cls(masks, renorm=renorm)

    @classmethod
    def everywhere(cls, info: ModelInfo, experts: Iterable[int], renorm: Renorm = "pruned") -> ExpertMask:
        """The same allowed experts at every MoE layer."""
        ids = list(experts)
        return cls.from_lists(info, {layer.index: ids for layer in info.layers}, renorm=renorm)

    def bind(self, info: ModelInfo) -> None:
        self._bound = {}
        for layer, mask in self.masks.items():
            rule = info.layer(layer).rule
            rule.check_allowed(mask, where=f"ExpertMask, MoE layer {layer}")
            self._bound[layer] = mask

    def apply(self, state: RoutingState) -> None:
        mask = self._bound.get(state.layer)
        if mask is None:
            return
        b, t, _ = state.logits.shape
        if mask.dim() == 1:
            allowed = mask.view(1, 1, -1)
        elif mask.dim() == 2:
            if mask.shape[0] != b:
                raise ValueError(
                    f"ExpertMask, MoE layer {state.layer}: [B, E] mask has B={mask.shape[0]}, batch is {b}"
                )
            allowed = mask[:, None, :]
        else:
            start, stop = state.ctx.offset, state.ctx.offset + t
            if mask.shape[0] != b or mask.shape[1] < stop:
                raise ValueError(
                    f"ExpertMask, MoE layer {state.layer}: [B, T, E] mask of shape {tuple(mask.shape)} does not "
                    f"cover batch {b}, positions {start}..{stop - 1}"
                )
            allowed = mask[:, start:stop]
        state.restrict(allowed, self.renorm)
