"""Batches of token sequences as the model takes them, and what a scoring forward returns.

``left_pad`` is the one place moectl lays token-id lists out as a left-padded batch (ids and
attention mask; optionally which positions are scored); ``prefill_groups`` splits prompts admitted
together into few such batches; ``TokenScores`` is the one result type of scoring a batch token by
token (plain, routed or RoE).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class TokenScores:
    """Per position t of a batch: ``logprob`` [B, T] = log p(x_t | x_<t) and ``greedy`` [B, T] =
    x_t is the argmax of that distribution (None where not computed); 0 and True where nothing
    was scored (position 0, padding)."""

    logprob: Tensor
    greedy: Tensor | None = None


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


SMALL_FORWARD = 256  # padded tokens below which a forward's cost is mostly reading the weights once


def prefill_groups(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices of prompts (of ``lengths``) to prefill together, one list per forward, in order.

    Prompts are taken longest first; a prompt joins the current forward while the forward's padded
    size (rows × its longest prompt) stays within ``max_tokens`` and padding is at most half of it,
    or the forward is small (≤ ``SMALL_FORWARD`` padded tokens: one weight read dominates, so one
    forward beats two whatever the padding). A prompt longer than ``max_tokens`` goes alone."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    real = width = 0
    for i in order:
        n = lengths[i]
        if groups:
            padded = (len(groups[-1]) + 1) * width
            if padded <= max_tokens and (padded <= 2 * (real + n) or padded <= SMALL_FORWARD):
                groups[-1].append(i)
                real += n
                continue
        groups.append([i])
        real = width = n
    return [sorted(g) for g in groups]
