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
from typing import Any

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo
from moectl.adapters.rules import Renorm
from moectl.errors import ConfigError
from moectl.routing.policy_config import PolicyConfig, layer_key, register_policy
from moectl.routing.routing_state import RoutingState, RowEffect

_RENORMS = ("pruned", "stock")
# the ways a policy file names the allowed experts (exactly one per expert_mask)
MASK_FORMS = ("experts", "keep", "everywhere", "masks")


@register_policy("expert_mask")
@dataclass
class ExpertMask(PolicyConfig):
    """Allowed experts per MoE layer: ``{moe_layer_index: bool tensor [E] | [B,E] | [B,T,E]}``.

    As a config (``to_dict`` / ``from_dict``)::

        {"type": "expert_mask", "format_version": 1, "renorm": "pruned", "num_experts": 8,
         "experts": {"0": [0, 1, 2, 3]}}            # or "everywhere": [0, 1, 2, 3]
                                                     # or "keep": {...} (a subset file's spelling)
                                                     # or "masks": {"0": nested 0/1 lists [B, E] | [B, T, E]}

    A subset file (``moectl subset select``, ``moectl baselines --out``) is an expert_mask with
    provenance fields (``model``, ``method``, ``calibration``), kept in ``meta`` and written back.
    """

    masks: dict[int, Tensor]
    renorm: Renorm = "pruned"
    meta: dict[str, Any] = field(default_factory=dict, repr=False)
    _bound: dict[int, Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.renorm not in _RENORMS:
            raise ConfigError(f"renorm must be one of {_RENORMS}, got {self.renorm!r}")
        clean: dict[int, Tensor] = {}
        for layer, mask in self.masks.items():
            mask = torch.as_tensor(mask)
            if mask.dtype != torch.bool:
                if not bool(((mask == 0) | (mask == 1)).all()):
                    raise ConfigError(
                        f"mask of MoE layer {layer} must be boolean or 0/1, got values outside {{0, 1}}"
                    )
                mask = mask.bool()
            if mask.dim() not in (1, 2, 3):
                raise ConfigError(
                    f"mask of MoE layer {layer} has shape {tuple(mask.shape)}; allowed shapes are [E], [B, E], [B, T, E]"
                )
            clean[int(layer)] = mask
        self.masks = clean

    @classmethod
    def from_lists(
        cls, info: ModelInfo, experts: Mapping[int, Iterable[int]], renorm: Renorm = "pruned"
    ) -> ExpertMask:
        """Allow the listed experts at each named MoE layer; other layers allow all experts.

        Refused here (not first inside ``route()``): a layer left with fewer reachable experts than
        its top-k (the layer's routing rule decides, grouped routers included)."""
        masks = {}
        for layer, ids in experts.items():
            n = info.layer(int(layer)).num_experts
            ids = [int(i) for i in ids]
            bad = [i for i in ids if not 0 <= i < n]
            if bad:
                raise ConfigError(
                    f"MoE layer {layer}: expert ids {bad} out of range; valid ids are 0..{n - 1}"
                )
            if len(set(ids)) != len(ids):
                raise ConfigError(f"MoE layer {layer}: duplicate expert ids in {ids}")
            mask = torch.zeros(n, dtype=torch.bool)
            mask[ids] = True
            info.layer(int(layer)).rule.check_allowed(mask, where=f"ExpertMask, MoE layer {layer}")
            masks[int(layer)] = mask
        return cls(masks, renorm=renorm)

    @classmethod
    def everywhere(cls, info: ModelInfo, experts: Iterable[int], renorm: Renorm = "pruned") -> ExpertMask:
        """The same allowed experts at every MoE layer."""
        ids = list(experts)
        return cls.from_lists(info, {layer.index: ids for layer in info.layers}, renorm=renorm)

    # -- config -------------------------------------------------------------------------------
    def expert_lists(self) -> dict[int, list[int]]:
        """``{layer: [allowed expert ids]}`` of the per-layer ``[E]`` masks (ValueError for per-token ones)."""
        out = {}
        for layer, mask in sorted(self.masks.items()):
            if mask.dim() != 1:
                raise ConfigError(
                    f"ExpertMask, MoE layer {layer}: a {mask.dim()}-d mask is not one expert set per layer"
                )
            out[layer] = mask.nonzero().flatten().tolist()
        return out

    def config_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"renorm": self.renorm}
        if all(m.dim() == 1 for m in self.masks.values()):
            sizes = {int(m.shape[-1]) for m in self.masks.values()}
            if len(sizes) == 1:
                fields["num_experts"] = sizes.pop()
            fields["experts"] = {str(k): v for k, v in self.expert_lists().items()}
        else:
            fields["masks"] = {str(k): m.int().tolist() for k, m in sorted(self.masks.items())}
        meta = {k: v for k, v in self.meta.items() if k not in fields and k not in ("type", "format_version")}
        return {**fields, **meta}

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], info: ModelInfo | None = None, *, model: nn.Module | None = None
    ) -> ExpertMask:
        """Read ``to_dict``'s object (or an older policy or subset file); ``info`` checks ids against the model."""
        renorm = data.get("renorm", "pruned")
        forms = [k for k in MASK_FORMS if k in data]
        known = {"type", "format_version", "renorm", "num_experts", *MASK_FORMS}
        meta = {k: v for k, v in data.items() if k not in known}
        if len(forms) != 1:
            raise ConfigError(
                "an expert_mask needs exactly one of 'experts' ({layer: [ids]}), 'keep' (the same, as subset "
                f"files spell it), 'everywhere' ([ids] at every MoE layer) or 'masks' ({{layer: 0/1 lists}}); got {forms or 'none'}"
            )
        form = forms[0]
        if form == "masks":
            if not isinstance(data["masks"], Mapping):
                raise ConfigError("'masks' must map MoE layer indices to nested 0/1 lists")
            masks = {layer_key(k): torch.tensor(v) for k, v in data["masks"].items()}
            mask = cls(masks, renorm=renorm, meta=meta)
            if info is not None:
                mask.bind(info)  # top-k reachable everywhere, checked now rather than inside route()
                mask._bound = {}
            return mask
        if form == "everywhere":
            if info is None:
                raise ConfigError("an expert_mask with 'everywhere' needs the model: load_policy(path, model)")
            mask = cls.everywhere(info, _id_list(data["everywhere"], "everywhere"), renorm=renorm)
            mask.meta = meta
            return mask
        lists = expert_lists_of(data[form], form)
        if info is not None:
            mask = cls.from_lists(info, lists, renorm=renorm)
            mask.meta = meta
            return mask
        n = data.get("num_experts")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(
                "this expert_mask does not record 'num_experts': pass the model, load_policy(path, model)"
            )
        masks = {}
        for layer, ids in lists.items():
            bad = [i for i in ids if not 0 <= i < n]
            if bad:
                raise ConfigError(f"MoE layer {layer}: expert ids {bad} out of range; valid ids are 0..{n - 1}")
            mask = torch.zeros(n, dtype=torch.bool)
            mask[ids] = True
            masks[layer] = mask
        return cls(masks, renorm=renorm, meta=meta)

    # -- policy ---------------------------------------------------------------------------------
    def bind(self, info: ModelInfo) -> None:
        self._bound = {}
        for layer, mask in self.masks.items():
            rule = info.layer(layer).rule
            rule.check_allowed(mask, where=f"ExpertMask, MoE layer {layer}")
            self._bound[layer] = mask

    def row_effect(self, layer: int) -> RowEffect | None:
        """One set of experts per layer is row-constant (``RowConstantPolicy``); per-row or per-position masks are not."""
        mask = self._bound.get(layer)
        if mask is None:
            return RowEffect()
        return RowEffect(allowed=mask, renorm=self.renorm) if mask.dim() == 1 else None

    def apply(self, state: RoutingState) -> None:
        mask = self._bound.get(state.layer)
        if mask is None:
            return
        b, t, _ = state.logits.shape
        if mask.dim() == 1:
            allowed = mask.view(1, 1, -1)
        elif mask.dim() == 2:
            if mask.shape[0] != b:
                raise ConfigError(
                    f"ExpertMask, MoE layer {state.layer}: [B, E] mask has B={mask.shape[0]}, batch is {b}"
                )
            allowed = mask[:, None, :]
        else:
            start, stop = state.ctx.offset, state.ctx.offset + t
            if mask.shape[0] != b or mask.shape[1] < stop:
                raise ConfigError(
                    f"ExpertMask, MoE layer {state.layer}: [B, T, E] mask of shape {tuple(mask.shape)} does not "
                    f"cover batch {b}, positions {start}..{stop - 1}"
                )
            allowed = mask[:, start:stop]
        state.restrict(allowed, self.renorm)


def _id_list(ids: Any, where: str) -> list[int]:
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(f"{where} must be a list of integer expert ids, got {ids!r}")
    if any(i < 0 for i in ids):
        raise ConfigError(f"{where}: negative expert ids in {ids}")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{where}: duplicate experts {sorted({i for i in ids if ids.count(i) > 1})}")
    return ids


def expert_lists_of(value: Any, form: str = "experts") -> dict[int, list[int]]:
    """``{layer: [ids]}`` from a JSON ``{"0": [ids], ...}``; ValueError naming the layer otherwise."""
    if not isinstance(value, Mapping) or not value:
        raise ConfigError(f"'{form}' must be a non-empty object mapping MoE layer indices to lists of expert ids")
    lists: dict[int, list[int]] = {}
    for key, ids in value.items():
        layer = layer_key(key, f"'{form}' layer")
        if layer in lists:
            raise ConfigError(f"MoE layer {layer} is listed twice in '{form}'")
        lists[layer] = _id_list(ids, f"MoE layer {layer}")
    return lists
