"""How the K routing samples of each token see the past: clean cache (RoE §2.3), separate caches, no cache.

Each variant answers the same two calls — ``start(prompt ids, mask)`` and ``step(next tokens)`` —
with the next-token logits of every sample, [B, K, V], for the last token fed. Sample 0 is always
the clean path (tau = 0). They differ in the history the noisy samples condition on and in cost:

- ``variant_clean.CleanCacheVariant`` (the paper's Clean Cache, §2.3): one KV cache built by the
  clean path; the K samples of a token run as K queries of one sequence over it.
- ``variant_separate.SeparateCachesVariant`` (the naive scheme §2.3 argues against): K cache rows
  per prompt, each with its own noisy history; memory grows linearly with K.
- ``variant_nocache.NoCacheVariant`` (the definition, Figure 4(b)'s no-cache baseline): every
  step recomputes all K samples from scratch, noise at the current token only.

Prompts are left-padded batches (``padding.left_padded``).
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor, nn

from moectl.ensemble.noise import SampleGumbel
from moectl.ensemble.variant_clean import CleanCacheVariant
from moectl.ensemble.variant_nocache import NoCacheVariant
from moectl.ensemble.variant_separate import SeparateCachesVariant
from moectl.errors import ConfigError

__all__ = [
    "VARIANTS",
    "CleanCacheVariant",
    "NoCacheVariant",
    "SampleVariant",
    "SeparateCachesVariant",
    "make_variant",
]


class SampleVariant(Protocol):
    """A way to run the K samples of each token (see the module docstring)."""

    K: int
    cache: object | None

    def start(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Feed a left-padded prompt batch; logits [B, K, V] of every sample at the last column."""

    def step(self, tokens: Tensor, valid: Tensor | None = None) -> Tensor:
        """Feed the next token of each row [B] (``valid`` False: a padding token, for scoring
        batches that start mid-way); logits [B, K, V] of every sample at it."""


VARIANTS: dict[str, type] = {
    "clean": CleanCacheVariant,
    "separate": SeparateCachesVariant,
    "none": NoCacheVariant,
}


def make_variant(mode: str, model: nn.Module, K: int, noise: SampleGumbel) -> SampleVariant:
    """The sample runner for ``RoEConfig.cache``."""
    if mode not in VARIANTS:
        raise ConfigError(f"cache must be one of {', '.join(VARIANTS)}, got {mode!r}")
    return VARIANTS[mode](model, K, noise)
