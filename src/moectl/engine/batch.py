"""Prompts admitted together, split into few left-padded prefill batches.

``prefill_groups`` splits prompts admitted together into few batches, each laid out by
``lm.padding.left_pad``.
"""

from __future__ import annotations

from collections.abc import Sequence

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
