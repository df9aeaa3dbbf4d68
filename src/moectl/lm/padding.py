"""Left-padded batches: the one layout moectl gives the model a batch of token sequences in.

``left_pad`` lays token-id lists out as a left-padded batch (ids and attention mask);
``scored_positions`` marks the positions of each row from its first scored index on;
``left_padded`` reads a left-padded ``attention_mask`` [B, P] (ones at the right) back into real-token
flags, left padding and position ids, as every RoE sample runner takes it; ``token_column`` is the
real-token flags of one column.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def left_pad(
    seqs: Sequence[Sequence[int]], pad_id: int, device: torch.device | str = "cpu"
) -> tuple[Tensor, Tensor]:
    """Token id lists -> (ids [B, L], attention mask [B, L] long), padded on the left."""
    if not seqs or any(len(s) == 0 for s in seqs):
        raise ValueError("every sequence needs at least one token")
    lengths = torch.tensor([len(s) for s in seqs])
    width = int(lengths.max())
    flat = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
    mask = torch.arange(width)[None, :] >= (width - lengths)[:, None]
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    ids[mask] = flat  # row-major: each row's tokens in order, right-aligned
    return ids.to(device), mask.long().to(device)


def scored_positions(mask: Tensor, firsts: Sequence[int]) -> Tensor:
    """[B, L] bool: the positions of each left-padded row from its first scored index on."""
    width = mask.shape[1]
    start = width - mask.sum(1) + torch.tensor(list(firsts), device=mask.device)
    return torch.arange(width, device=mask.device)[None, :] >= start[:, None]


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
