"""What a scoring forward returns: the one result type of scoring a batch token by token (plain,
routed or RoE)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass
class TokenScores:
    """Per position t of a batch: ``logprob`` [B, T] = log p(x_t | x_<t) and ``greedy`` [B, T] =
    x_t is the argmax of that distribution (None where not computed); 0 and True where nothing
    was scored (position 0, padding)."""

    logprob: Tensor
    greedy: Tensor | None = None
