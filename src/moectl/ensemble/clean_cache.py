"""The clean KV cache of RoE §2.3: one sequence's keys and values, whatever K is.

A clean-cache step feeds the current token as K query tokens of one sequence
(``variant_clean.CleanCacheVariant``). ``CleanCacheMixin.update`` appends only query 0's (the
clean sample's) keys/values to the cache and hands the attention call prefix + the K new keys
(one concatenation, freed after that layer: the same per-layer copy transformers'
``DynamicCache`` makes for the plain model every step). ``StepPlan`` says what a step commits and
which cached tokens its queries may see. ``FullCleanCache`` keeps every token in every layer (the
span scorer's, ``roe.spans``: a span's queries read keys a sliding window has already passed).

The sample runners live beside it: ``variants`` (the three ways to run K samples),
``cache_size`` (bytes and tokens a cache holds), ``lm.padding`` (left-padded prompt batches).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

__all__ = [
    "CleanCache",
    "CleanCacheMixin",
    "FullCleanCache",
    "StepPlan",
    "full_clean_cache",
    "new_clean_cache",
]


@dataclass(frozen=True)
class StepPlan:
    """How ``CleanCache.update`` treats the next forward's keys/values.

    ``commit``: how many leading new tokens to append (1: the clean sample; 0: none).
    ``exclude``: how many of the newest cached tokens the queries must not see (1 when the clean
    token of this position was already committed, as in adaptive K's second pass).
    ``rows``: batch rows taking part (None: all), for passes over a subset of the prompts.
    """

    commit: int = 1
    exclude: int = 0
    rows: Tensor | None = None


class CleanCacheMixin:
    """Makes a transformers cache append only the clean sample's K/V during an RoE step.

    Outside a step (``plan is None``: the clean prefill) the cache behaves as its base class.
    Sliding-window layers record their past until ``trim()`` so that a step can still see the
    token a commit just pushed out of the window.
    """

    layers: list
    plan: StepPlan | None = None

    def _init_clean(self) -> None:
        for layer in self.layers:
            if isinstance(layer, DynamicSlidingWindowLayer):
                layer.activate_past_recording()
        self.plan = None

    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[Tensor, Tensor]:
        plan = self.plan
        if plan is None:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)  # type: ignore[misc]
        while len(self.layers) <= layer_idx:  # caches that add layers lazily
            self.layers.append(DynamicLayer())
        layer = self.layers[layer_idx]
        keep = self.prefix_length(layer_idx, plan.exclude)
        if keep > 0:
            past_k, past_v = layer.keys[..., :keep, :], layer.values[..., :keep, :]
            if plan.rows is not None:
                past_k, past_v = past_k[plan.rows], past_v[plan.rows]
        else:
            past_k, past_v = key_states[..., :0, :], value_states[..., :0, :]
        if plan.commit:
            layer.update(key_states[..., : plan.commit, :], value_states[..., : plan.commit, :])
        return torch.cat([past_k, key_states], dim=-2), torch.cat([past_v, value_states], dim=-2)

    def prefix_length(self, layer_idx: int, exclude: int = 0) -> int:
        """Cached tokens a step's queries read at decoder layer ``layer_idx``."""
        if layer_idx >= len(self.layers):
            return 0
        layer = self.layers[layer_idx]
        if not getattr(layer, "is_initialized", False) or layer.keys is None or layer.keys.numel() == 0:
            return 0
        return layer.keys.shape[-2] - exclude

    def trim(self) -> None:
        """Drop what sliding-window layers no longer need (their last W − 1 tokens stay)."""
        for layer in self.layers:
            if (
                isinstance(layer, DynamicSlidingWindowLayer)
                and layer.is_initialized
                and layer.keys is not None
            ):
                layer.crop(0)


class CleanCache(CleanCacheMixin, DynamicCache):
    """The clean cache on a ``DynamicCache`` (per-layer types from the model config)."""

    def __init__(self, config) -> None:
        DynamicCache.__init__(self, config=config)
        self._init_clean()


def new_clean_cache(model: nn.Module) -> CleanCacheMixin:
    """A clean cache of the cache class the model requires (MiniMax insists on its own)."""
    if getattr(model.config, "model_type", "") == "minimax":
        from transformers.models.minimax.modeling_minimax import MiniMaxCache

        class CleanMiniMaxCache(CleanCacheMixin, MiniMaxCache):
            def __init__(self) -> None:
                MiniMaxCache.__init__(self)
                self._init_clean()

        return CleanMiniMaxCache()
    return CleanCache(model.config)


class FullCleanCache(CleanCacheMixin, DynamicCache):
    """A clean cache whose layers all keep every token (sliding-window layers too: a span's
    queries read keys the window has already passed)."""

    def __init__(self) -> None:
        DynamicCache.__init__(self)
        self._init_clean()


def full_clean_cache(model: nn.Module) -> CleanCacheMixin:
    """A :class:`FullCleanCache`, or the clean cache of the class the model insists on (MiniMax)."""
    if getattr(model.config, "model_type", "") == "minimax":
        return new_clean_cache(model)
    return FullCleanCache()
