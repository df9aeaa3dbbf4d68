"""No cache: the definition the clean cache must equal, and Figure 4(b)'s no-cache baseline (RoE §2.3).

Every step recomputes all K samples over the whole sequence from scratch, noise only at the
current token: sample k sees the clean prefix and its own noisy routing for the current token.
The clean cache must give the same logits (tests check it, greedy tokens included).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moectl.ensemble.noise import NoiseLayout, SampleGumbel
from moectl.lm.padding import left_padded, token_column


class NoCacheVariant:
    """Recompute all K samples from scratch each token, clean prefix, noise at the current token only."""

    def __init__(self, model: nn.Module, K: int, noise: SampleGumbel) -> None:
        self.model, self.K, self.noise = model, int(K), noise
        self.cache = None

    def start(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        left_padded(attention_mask)
        self.ids, self.mask = input_ids, attention_mask
        return self._run()

    def step(self, tokens: Tensor, valid: Tensor | None = None) -> Tensor:
        self.ids = torch.cat([self.ids, tokens[:, None]], dim=1)
        self.mask = torch.cat([self.mask, token_column(valid, tokens)[:, None].to(self.mask.dtype)], dim=1)
        return self._run()

    def _run(self) -> Tensor:
        _, _, position = left_padded(self.mask)
        k, length = self.K, self.ids.shape[1]
        device = self.ids.device
        sample = (torch.arange(self.ids.shape[0] * k, device=device) % k)[:, None]
        current = torch.arange(length, device=device)[None, :] == length - 1
        self.noise.layout = (
            NoiseLayout(
                sample=sample, position=position.repeat_interleave(k, dim=0), scale=(sample > 0) & current
            )
            if k > 1
            else None
        )
        try:
            out = self.model(
                input_ids=self.ids.repeat_interleave(k, dim=0),
                attention_mask=self.mask.repeat_interleave(k, dim=0),
                position_ids=position.repeat_interleave(k, dim=0),
                use_cache=False,
                logits_to_keep=1,
            )
        finally:
            self.noise.layout = None
        return out.logits[:, -1].reshape(-1, k, out.logits.shape[-1])
