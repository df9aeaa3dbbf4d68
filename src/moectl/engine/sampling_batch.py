"""What the sampler needs of a batch's requests, as tensors built once per change of the batch.

A decoding step samples every running request's next token with its own temperature, top-p,
top-k, min-p and keyed noise (``sampling.choose_tokens``). Building those tensors from the
requests' fields at every step (a ``torch.tensor([...])`` of Python values and a host-to-device
copy) costs per step what only changes when a request joins or leaves; here they are built when
the batch changes (:meth:`SamplingBatch.of`, :meth:`join`, :meth:`keep`) and only the
generated-token index moves each step (:meth:`advance`, on the device) — vLLM's
``SamplingMetadata``, rebuilt only on a change of the batch as its persistent batch does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from moectl.engine.sampling import SamplingParams, choose_tokens


@dataclass
class SamplingBatch:
    """Per request (not per row: a request of K copies samples once): its parameters as tensors."""

    floats: Tensor  # [R, 3] temperature, top-p, min-p
    keys: Tensor  # [R] int64 seed keys (``keyed_hash.seed_key``)
    steps: Tensor  # [R] int64: the index of the token each request samples next
    top_k: Tensor  # [R] int64, 0: off
    greedy: bool  # every request greedy: an argmax, nothing else
    filters: bool  # some request filters by top-k or min-p

    @classmethod
    def of(cls, params: Sequence[SamplingParams], keys: Sequence[int], steps: Sequence[int], device) -> SamplingBatch:
        floats = torch.tensor([[p.temperature, p.top_p, p.min_p] for p in params], dtype=torch.float32)
        ints = torch.tensor([[k, s, p.top_k] for p, k, s in zip(params, keys, steps, strict=True)], dtype=torch.int64)
        floats, ints = floats.to(device, non_blocking=True), ints.to(device, non_blocking=True)
        return cls(
            floats,
            ints[:, 0],
            ints[:, 1].clone(),
            ints[:, 2],
            all(p.temperature == 0 for p in params),
            any(p.top_k or p.min_p for p in params),
        )

    def choose(self, logits: Tensor) -> Tensor:
        """Each request's next token from its (penalised) logits [R, V]."""
        if self.greedy:
            return logits.argmax(-1)
        filters = self.filters
        return choose_tokens(
            logits.float(), self.floats[:, 0], self.floats[:, 1], self.keys, self.steps,
            top_k=self.top_k if filters else None, min_p=self.floats[:, 2] if filters else None,
        )  # fmt: skip

    def advance(self) -> None:
        """Every request sampled one token: the next step samples each one's next index."""
        self.steps += 1

    def join(self, other: SamplingBatch) -> SamplingBatch:
        return SamplingBatch(
            torch.cat([self.floats, other.floats]),
            torch.cat([self.keys, other.keys]),
            torch.cat([self.steps, other.steps]),
            torch.cat([self.top_k, other.top_k]),
            self.greedy and other.greedy,
            self.filters or other.filters,
        )

    def keep(self, index: Tensor, params: Sequence[SamplingParams]) -> SamplingBatch:
        """The requests at ``index`` (their ``params``, in order, for the host flags)."""
        return SamplingBatch(
            self.floats[index],
            self.keys[index],
            self.steps[index],
            self.top_k[index],
            all(p.temperature == 0 for p in params),
            any(p.top_k or p.min_p for p in params),
        )
