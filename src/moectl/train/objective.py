"""The language-modelling loss as a module, so ``accelerate.prepare`` wraps the whole forward.

``NextTokenLoss(model)(input_ids)`` runs the decoder (``model.model``), then the LM head and the
cross-entropy together in chunks (``fused_ce.linear_cross_entropy``): the step never holds the
[B, T, V] logits. Under autocast the head runs in the autocast dtype, the softmax in float32.
The value equals ``model(input_ids, labels=input_ids).loss`` (tested).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moectl.train.fused_ce import linear_cross_entropy


class NextTokenLoss(nn.Module):
    """Mean next-token cross-entropy of a causal LM over every position of ``input_ids``."""

    def __init__(self, model: nn.Module, fused: bool = True) -> None:
        super().__init__()
        self.model = model
        self.fused = fused

    def forward(self, input_ids: Tensor) -> Tensor:
        if not self.fused:  # transformers' own loss: full [B, T, V] logits (for comparison)
            return self.model(input_ids=input_ids, labels=input_ids).loss
        hidden = self.model.model(input_ids=input_ids).last_hidden_state  # [B, T, H]
        head = self.model.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise ValueError("NextTokenLoss(fused=True) needs an LM head without bias")
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        return linear_cross_entropy(hidden[:, :-1], head.weight, input_ids[:, 1:], compute_dtype=dtype)
