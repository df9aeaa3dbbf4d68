"""The repeats row kind: one request as K routed copies (K batch rows), one shared token stream.

A routing with ``repeats = K`` (``Routing.repeats``; evaluation's ``BatchRouting.repeats``) runs each
request as K consecutive rows of the batch, each copy routed by its own draws (request-keyed
Gumbel noise gives copy c its own code, ``moectl.eval.request_noise.set_request_codes``), with its
own KV cache and routing history. At every step the copies' next-token distributions are averaged
in probability space, ``log (1/K) Σ_k p_k = logsumexp_k log_softmax(logits_k) − log K``, one token
is chosen from the average (``sampling.choose_tokens``) and fed to all K rows.

Rows of one-copy requests keep their raw logits (the engine's sampling is unchanged for them); the
combination is one vectorised reduction per distinct K in the batch, not a loop over requests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def row_starts(copies: Sequence[int]) -> list[int]:
    """The first batch row of each request, its ``copies[i]`` rows following one another."""
    starts, row = [], 0
    for c in copies:
        starts.append(row)
        row += c
    return starts


def rows_of(copies: Sequence[int], requests: Sequence[int]) -> list[int]:
    """The batch rows of the requests at indices ``requests`` (each request's copies, in order)."""
    starts = row_starts(copies)
    return [row for i in requests for row in range(starts[i], starts[i] + copies[i])]


def expand(values: Tensor, copies: Sequence[int]) -> Tensor:
    """Per-request ``values`` [N, ...] -> per-row [R, ...] (each repeated for its request's copies)."""
    if all(c == 1 for c in copies):
        return values
    return values.repeat_interleave(torch.tensor(list(copies), device=values.device), dim=0)


def combine(logits: Tensor, copies: Sequence[int]) -> Tensor:
    """Next-token scores [N, V] per request from the rows' logits [R, V] (R = Σ copies).

    A one-copy request keeps its logits; a K-copy request gets the log of its copies' mean
    probability, ``logsumexp_k log_softmax(logits_k) − log K`` (float32)."""
    if all(c == 1 for c in copies):
        return logits
    if logits.shape[0] != sum(copies):
        raise ValueError(f"{logits.shape[0]} rows of logits for requests of {sum(copies)} rows")
    dev = logits.device
    starts = row_starts(copies)
    out = torch.empty(len(copies), logits.shape[-1], dtype=torch.float32, device=dev)
    for k in sorted(set(copies)):  # one reduction per distinct copy count (host lists: no sync)
        which = [i for i, c in enumerate(copies) if c == k]
        first = torch.tensor([starts[i] for i in which], device=dev)
        if k == 1:
            out[which] = logits[first].float()
            continue
        rows = first[:, None] + torch.arange(k, device=dev)  # [m, k]
        logp = F.log_softmax(logits[rows].float(), dim=-1)  # [m, k, V]
        out[which] = torch.logsumexp(logp, dim=1) - math.log(k)
    return out
