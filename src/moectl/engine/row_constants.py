"""The routing a batch's rows get whatever their tokens: prepared once, read at every MoE layer.

A routing of row-constant policies (``RowConstantPolicy``: an expert mask of one set per layer,
forced/omitted experts, ``topk:N``, the ``option:K`` lens) does the same to every token of its rows
at a layer. ``ConstantRows`` gathers the groups of such routings into per-layer batch tensors once
— allowed and forced experts [B, 1, E] per MoE layer, the rows restricted there, each ``topk:N``'s
rows — so that ``RowRouter`` reads a layer's tensors instead of calling each group's policies on a
cut of the layer's state (#39 item 2: routing as tensors on the hot path). The engine's groups are
rebuilt at every step; ``RowRouter`` keeps the prepared tensors while the constant groups' rows and
routings stay the same (most decoding steps). Groups of other routings (noise, pools, controllers,
replay) still run their policies per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moectl.routing.protocols import RowConstantPolicy
from moectl.routing.routing_state import RowEffect


def row_effects(policies: list, num_layers: int) -> list[RowEffect] | None:
    """Each layer's composed effect of ``policies`` where every one is row-constant there, else None."""
    if not policies or not all(isinstance(p, RowConstantPolicy) for p in policies):
        return None
    out = []
    for layer in range(num_layers):
        effect = RowEffect()
        for policy in policies:
            one = policy.row_effect(layer)
            if one is None:
                return None
            effect = effect.then(one)
        out.append(effect)
    return out


@dataclass
class LayerRows:
    """One MoE layer's prepared routing: [B, 1, E] allowed / forced (None: none of the rows), the
    rows [B] whose routing restricts this layer."""

    allowed: Tensor | None
    forced: Tensor | None
    restricting: Tensor | None


class ConstantRows:
    """Per-layer batch tensors of the row-constant groups of a forward (see the module doc)."""

    def __init__(
        self, groups: list[tuple[Tensor, list[RowEffect]]], batch: int, num_experts: list[int], device: torch.device
    ) -> None:
        self.top_k: dict[int, Tensor] = {}  # N -> rows choosing N experts
        self.renorm = "pruned"
        rows_of_k: dict[int, list[Tensor]] = {}
        self.layers: list[LayerRows] = []
        for layer, experts in enumerate(num_experts):
            allowed = forced = restricting = None
            for rows, effects in groups:
                effect = effects[layer]
                rows = rows.to(device)
                if effect.allowed is not None:
                    if allowed is None:
                        allowed = torch.ones(batch, 1, experts, dtype=torch.bool, device=device)
                        restricting = torch.zeros(batch, dtype=torch.bool, device=device)
                    allowed[rows, 0] = effect.allowed.to(device)
                    restricting[rows] = True  # type: ignore[index]
                    self.renorm = effect.renorm
                if effect.forced is not None:
                    if forced is None:
                        forced = torch.zeros(batch, 1, experts, dtype=torch.bool, device=device)
                    forced[rows, 0] = effect.forced.to(device)
                if layer == 0 and effect.top_k is not None:
                    rows_of_k.setdefault(effect.top_k, []).append(rows)
            self.layers.append(LayerRows(allowed, forced, restricting))
        self.top_k = {k: torch.cat(rows) for k, rows in rows_of_k.items()}
