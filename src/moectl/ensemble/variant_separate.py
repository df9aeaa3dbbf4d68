"""Separate caches (the naive scheme RoE §2.3 argues against): K cache rows per prompt.

Each sample has its own cache row and its own noisy history (prompt included); memory grows
linearly with K. The comparison point of the clean cache's memory figures (RoE §3.3).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moectl.ensemble.noise import NoiseLayout, SampleGumbel
from moectl.lm.padding import left_padded, token_column
from moectl.routing.kv_cache import cache_out, with_cache


class SeparateCachesVariant:
    """K cache rows per prompt, each sample with its own noisy history (memory grows with K)."""

    def __init__(self, model: nn.Module, K: int, noise: SampleGumbel) -> None:
        self.model, self.K, self.noise = model, int(K), noise
        self.cache = None

    def start(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        valid, _, position = left_padded(attention_mask)
        self.cache = None  # the model creates the cache class it needs on the first forward
        self.mask = attention_mask.repeat_interleave(self.K, dim=0)
        self.n_real = valid.sum(1).repeat_interleave(self.K)
        return self._run(
            input_ids.repeat_interleave(self.K, dim=0), position.repeat_interleave(self.K, dim=0)
        )

    def step(self, tokens: Tensor, valid: Tensor | None = None) -> Tensor:
        column = token_column(valid, tokens).repeat_interleave(self.K)
        self.mask = torch.cat([self.mask, column[:, None].to(self.mask.dtype)], dim=1)
        position = torch.where(column, self.n_real, 0)[:, None]
        self.n_real = self.n_real + column.long()
        return self._run(tokens.repeat_interleave(self.K)[:, None], position)

    def _run(self, ids: Tensor, position: Tensor) -> Tensor:
        sample = (torch.arange(ids.shape[0], device=ids.device) % self.K)[:, None]
        self.noise.layout = (
            NoiseLayout(sample=sample, position=position, scale=sample > 0) if self.K > 1 else None
        )
        try:
            out = self.model(
                input_ids=ids,
                attention_mask=self.mask,
                position_ids=position,
                **with_cache(self.cache),
                use_cache=True,
                logits_to_keep=1,
            )
        finally:
            self.noise.layout = None
        self.cache = cache_out(out)
        return out.logits[:, -1].reshape(-1, self.K, out.logits.shape[-1])
