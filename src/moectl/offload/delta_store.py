"""Expert weights with an adapter's delta added as they are loaded.

A trained controller's adapters on the experts (TE-MoE §4.3) are merged into the expert weights
when the model holds them. A model served from a checkpoint's shards holds none (its experts are
on the meta device, ``moectl.models.lazy``), so ``moectl.options`` attaches the adapters to each
experts module instead (:func:`set_pending_delta`: an object with ``delta(expert) -> {parameter:
Tensor}``, kept in a registry keyed weakly by the module, not on the user's module), and
the offloading runtime reads experts through :class:`DeltaStore`, which adds the delta to each
expert on its way into a resident slot: the weights served are the merged ones, one expert at a
time, and the checkpoint is never changed.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import Tensor, nn

# experts module -> its pending delta; the entry goes when the module does
_PENDING: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def set_pending_delta(experts: nn.Module, pending: Any) -> None:
    """Record ``pending`` (``delta(expert) -> {parameter: Tensor}``) as what loading ``experts``'s
    experts adds (``moectl.options.expert_lora`` does, for adapters of experts not in memory)."""
    _PENDING[experts] = pending


def pending_delta(experts: nn.Module) -> Any | None:
    """The pending delta recorded for ``experts``, or None."""
    return _PENDING.get(experts)


class DeltaStore:
    """``load(layer, expert)`` of ``inner`` plus ``deltas[layer].delta(expert)`` where a layer has one."""

    def __init__(self, inner, deltas: dict[int, Any]) -> None:
        self.inner, self.deltas = inner, deltas

    def load(self, layer: int, expert: int) -> dict[str, Tensor]:
        weights = self.inner.load(layer, expert)
        pending = self.deltas.get(layer)
        if pending is None:
            return weights
        out = dict(weights)
        for name, delta in pending.delta(expert).items():
            w = weights[name]
            out[name] = w + delta.to(w.device, w.dtype)  # merge_expert_lora's arithmetic; out of place
        return out
