"""The running batch: the requests decoding together and the tensors of their rows, kept in step.

A request of K routed copies takes K rows (``repeats.py``); every tensor here is per row, but for
the sampler's, which is per request. Rows join after their prefill (:meth:`RunningBatch.join`),
leave when their request finishes or is cancelled (:meth:`drop`), and move one token on after each
decoding forward (:meth:`advance`); nothing else writes these tensors, so they cannot fall out of
step (the engine once kept five of them side by side by hand).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from moectl.engine.kv import join, keep
from moectl.engine.repeats import rows_of
from moectl.engine.sampling_batch import SamplingBatch


class RunningBatch:
    """Requests (objects with ``copies``, ``seen``, ``params``, ``switches``) and their rows' state."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.requests: list[Any] = []
        self.cache: Any = None  # the KV cache, one row per copy
        self.valid: Tensor | None = None  # [B, T] which cache positions hold tokens (left padding)
        self.prev: Tensor | None = None  # [B, L, E] ω at each row's latest token (SwitchMeter)
        self.switches: Tensor | None = None  # [B, L] switches counted so far
        self.last: Tensor | None = None  # [B] each row's latest token, fed at the next step
        self.positions: Tensor | None = None  # [B, 1] the position of each row's next token
        self.sampling: SamplingBatch | None = None  # per request

    def __len__(self) -> int:
        return len(self.requests)

    def __bool__(self) -> bool:
        return bool(self.requests)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.requests)

    @property
    def rows(self) -> int:
        return 0 if self.last is None else int(self.last.shape[0])

    def copies(self) -> list[int]:
        return [r.copies for r in self.requests]

    def join(
        self, reqs: list[Any], cache: Any, mask: Tensor, prev: Tensor, switches: Tensor, tokens: Tensor,
        sampling: SamplingBatch,
    ) -> int:  # fmt: skip
        """Prefilled ``reqs`` join: their cache rows (left-padded as ``mask`` [rows, T] marks), ω,
        switch counts, first tokens ``tokens`` [rows] and sampling state (whose steps have been
        advanced past their first token). Returns the index of the first one."""
        self.cache, self.valid = join(self.cache, self.valid, cache, mask)
        self.prev = _cat(self.prev, prev)
        self.switches = _cat(self.switches, switches)
        self.last = _cat(self.last, tokens)
        seen = torch.tensor([[r.seen] for r in reqs for _ in range(r.copies)], device=self.device)
        self.positions = _cat(self.positions, seen)
        self.sampling = sampling if self.sampling is None else self.sampling.join(sampling)
        first = len(self.requests)
        self.requests.extend(reqs)
        return first

    def advance(self, cache: Any, valid: Tensor, tokens: Tensor) -> None:
        """After a decoding forward: its cache and valid positions, every row one token on, each
        request's sampler one index on, ``tokens`` [rows] fed at the next step."""
        self.cache, self.valid, self.last = cache, valid, tokens
        assert self.positions is not None and self.sampling is not None
        self.positions += 1
        self.sampling.advance()
        for req in self.requests:
            req.seen += 1

    def drop(self, gone: set[int]) -> list[Any]:
        """Remove the requests at indices ``gone``; each one's switch count summed over its rows
        first (one host sync per leave). Returns them, in batch order."""
        copies = self.copies()
        done = [self.requests[i] for i in sorted(gone)]
        if self.switches is not None:
            per_row = self.switches.sum(1).tolist()
            for i in gone:  # a request of K copies: the sum over its rows (the engine divides by K)
                self.requests[i].switches = int(sum(per_row[r] for r in rows_of(copies, [i])))
        kept = [i for i in range(len(self.requests)) if i not in gone]
        if not kept:
            self.clear()
            return done
        rows = torch.tensor(rows_of(copies, kept), dtype=torch.long, device=self.device)
        self.cache, self.valid = keep(self.cache, self.valid, rows)
        self.prev = self.prev[rows] if self.prev is not None else None
        self.switches = self.switches[rows] if self.switches is not None else None
        self.last = self.last[rows] if self.last is not None else None
        self.positions = self.positions[rows] if self.positions is not None else None
        self.requests = [self.requests[i] for i in kept]
        if self.sampling is not None:
            index = torch.tensor(kept, dtype=torch.long, device=self.sampling.keys.device)
            self.sampling = self.sampling.keep(index, [r.params for r in self.requests])
        return done

    def clear(self) -> list[Any]:
        """Empty the batch; returns the requests it held."""
        held, self.requests = self.requests, []
        self.cache = self.valid = self.prev = self.switches = self.last = self.positions = None
        self.sampling = None
        return held


def _cat(old: Tensor | None, new: Tensor) -> Tensor:
    return new if old is None else torch.cat([old, new])
