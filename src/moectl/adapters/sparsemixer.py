"""Phi-MoE's sparsemixer at inference (transformers ``modeling_phimoe.sparsemixer``, eval path).

Two experts, picked one after the other from the router logits g:

1. first = argmax g. Experts j with (g[first] − g[j]) / max(|g[j]|, g[first]) > 2·jitter_eps are
   masked out (−inf); its weight is the softmax of the masked logits at ``first``.
2. second = argmax of g without ``first``; the same threshold around g[second], with ``first``
   also masked out; its weight is the softmax of those masked logits at ``second``.

The source always picks two; the router's ``top_k`` is not read.

moectl's additions, each reducing to the source's rule when every expert is allowed and there is
no noise:

- masks: a pick is the best *allowed* expert. ``renorm="pruned"`` also removes the disallowed
  experts from both masked softmaxes (what slicing them out gives); ``"stock"`` keeps them there
  when they fall within the threshold.
- noise (RoE §2.1): a pick is the argmax of g + noise; the threshold is centred on the picked
  expert's un-noised logit (the source centres it on the maximum, which is the pick without noise).

The threshold is decided in ``threshold_dtype``, the router's dtype (the source works in the
logits' dtype: in bf16 a logit near the threshold may fall on the other side than in float32).
Deviation: the softmaxes are computed in float32 (the source: in the logits' dtype), so bf16/fp16
weights differ by rounding; re-inspect a model after changing its dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moectl.adapters.rules import MASKED, Renorm


def sparsemixer(
    logits: Tensor,
    jitter_eps: float,
    allowed: Tensor | None = None,
    noise: Tensor | None = None,
    renorm: Renorm = "pruned",
    threshold_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """(weights [N, 2], indices [N, 2]) for logits [N, E] float32; ``allowed`` bool broadcastable to [N, E]."""
    choose = logits if noise is None else logits + noise
    allowed = None if allowed is None else allowed.expand_as(logits)
    absent = None if allowed is None or renorm != "pruned" else ~allowed  # out of the masked softmaxes
    first = _pick(choose, allowed)
    taken = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, first, True)
    second = _pick(choose, ~taken if allowed is None else allowed & ~taken)
    weights = torch.cat(
        [
            _masked_gate(logits, first, absent, jitter_eps, threshold_dtype),
            _masked_gate(
                logits, second, taken if absent is None else absent | taken, jitter_eps, threshold_dtype
            ),
        ],
        dim=-1,
    )
    return weights, torch.cat([first, second], dim=-1)


def _pick(choose: Tensor, allowed: Tensor | None) -> Tensor:
    """[N, 1] the argmax over the allowed experts (``max`` as the source, so ties break alike)."""
    if allowed is not None:
        choose = choose.masked_fill(~allowed, MASKED)
    return choose.max(dim=-1, keepdim=True).indices


def _masked_gate(
    logits: Tensor, pick: Tensor, absent: Tensor | None, jitter_eps: float, dtype: torch.dtype
) -> Tensor:
    """[N, 1] softmax over the experts within the jitter threshold of ``pick`` (and not absent), at ``pick``."""
    g = logits.to(dtype)
    centre = g.gather(-1, pick)
    factor = g.abs().clamp(min=centre)
    outside = (centre - g) / factor > 2 * jitter_eps  # never the pick itself: 0 (or 0/0 = NaN) is not > x
    if absent is not None:
        outside = outside | absent
    return torch.softmax(logits.masked_fill(outside, float("-inf")), dim=-1).gather(-1, pick)
