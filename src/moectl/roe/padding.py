"""Left-padded prompt batches, as every RoE sample runner takes them (``attention_mask`` [B, P], ones at the right)."""

from __future__ import annotations

import torch
from torch import Tensor


def left_padded(attention_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(valid [B, P] bool, left padding [B], position ids [B, P]) of a left-padded batch; raise otherwise.

    A row may still be all padding (teacher-forced scoring starts batches mid-way); what is
    refused is padding *after* a real token.
    """
    valid = attention_mask.bool()
    if valid.dim() != 2:
        raise ValueError(f"attention_mask must be [batch, length], got shape {tuple(attention_mask.shape)}")
    if bool((valid[:, :-1] & ~valid[:, 1:]).any()):
        raise ValueError("RoE needs left-padded batches: a row has padding after a real token")
    left_pad = (~valid).sum(1)
    position = (valid.long().cumsum(1) - 1).clamp(min=0)
    return valid, left_pad, position


def token_column(valid: Tensor | None, like: Tensor) -> Tensor:
    """Real-token flags [B] of the next column: ``valid`` as bool on ``like``'s device, all True if None."""
    return torch.ones_like(like, dtype=torch.bool) if valid is None else valid.to(like.device, torch.bool)
