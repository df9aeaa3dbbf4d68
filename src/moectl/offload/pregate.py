"""``pregate``: pre-gating prefetch — at MoE layer l, predict layer l+1's experts for the same token
and start loading them, so that their loads overlap layer l's compute.

The prediction applies layer l+1's own router to layer l's router input h_l (the residual stream
changes little from one layer to the next) and takes its top-k with the family's rule; the
experts missing from layer l+1's resident set are prefetched (``ResidentSet.prefetch``: into free
or evictable slots only, never over what is pinned or was used at the last step). Residency is
the runtime's LRU; routing is the model's own, so the generated tokens are the same as ``lru``'s.
Only decoding steps predict; MoE layer 0 is never predicted (there is no layer before it).

Deviation: Pre-gated MoE (Hwang et al., ISCA 2024) trains a pre-gate per layer on h_l; this
applies the next layer's trained router to h_l instead (training-free, as MoE-Infinity-style
predictors do). ``prefetch_hits / prefetch_loads`` in the totals is its accuracy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo, MoELayer
from moectl.offload.prefetch import HiddenTap
from moectl.offload.residency import ResidencyPolicy
from moectl.routing.policy_config import register_policy
from moectl.subsets.experts import router_logits, select


@torch.no_grad()
def pregate_prediction(next_layer: MoELayer, hidden: Tensor) -> list[int]:
    """Layer ``next_layer``'s top-k experts (its router and rule) for router input ``hidden`` [H]."""
    logits = router_logits(next_layer, hidden.reshape(1, -1))
    return select(next_layer, logits)[1][0].tolist()


@register_policy("pregate")
class PregateResidency(ResidencyPolicy):
    """LRU residency with pre-gating prefetch of the next MoE layer's experts (see the module doc)."""

    pins = False  # LRU: nothing pinned (prefetches go into free or evictable slots)

    def __init__(self) -> None:
        self.name = "pregate"
        self.tap = HiddenTap()
        self.info: ModelInfo | None = None
        self.sets: dict[int, Any] = {}  # MoE layer -> its ResidentSet, as the runtime passes it
        self.predicted = 0  # prefetches started
        self._guess: dict[int, set[int]] = {}  # MoE layer -> the experts predicted for it this step
        self.recall_hits = self.recall_total = 0  # recall@k of the predictions, over decoding steps

    def config_fields(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], info: ModelInfo | None = None, *, model: nn.Module | None = None
    ) -> PregateResidency:
        return cls()

    def routing(self, info) -> list:
        self.info = info
        return [self.tap]

    def before(self, layer: int, res, chosen: Tensor, probs: Tensor | None) -> None:
        res.pinned.clear()  # LRU residency
        self.sets[layer] = res
        guess = self._guess.pop(layer, None)
        if guess is not None and chosen.shape[0] == 1:  # recall@k: the chosen experts that were predicted
            actual = set(chosen[0].tolist())
            self.recall_hits += len(actual & guess)
            self.recall_total += len(actual)
        target = self.sets.get(layer + 1)
        hidden = self.tap.hidden.get(layer)
        if chosen.shape[0] != 1 or target is None or hidden is None or self.info is None:
            return
        predicted = pregate_prediction(self.info.layer(layer + 1), hidden[0])
        self._guess[layer + 1] = set(predicted)
        self.predicted += target.prefetch(predicted)

    def report(self) -> dict[str, Any]:
        """recall@k of the predictions: of the k experts each decoding token chose at a layer, the
        share layer l's pre-gate had predicted."""
        recall = self.recall_hits / self.recall_total if self.recall_total else None
        return {"prediction_recall_at_k": recall, "predicted_tokens_layers": self.recall_total}
