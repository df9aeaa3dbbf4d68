"""What each selection method keeps of the calibration tokens, one MoE layer, batch by batch.

A method needs a statistic of the block inputs x_t of the real tokens (EMO §4.2: padding
excluded), not the tokens themselves:

- ``router``: Σ_t p_t, the router distributions summed (→ mean routing probability);
- ``frequency``: how often each expert is in a token's top-k;
- ``wanda``: Σ_t x_t² per input channel (→ ‖X_c‖₂);
- ``easy_ep``: Σ_t g_{i,t}·‖E_i(x_t)‖·s_t — a sum over tokens, so exactly the sum of the batches';
- ``reap``: Σ_{t routed to i} g_{i,t}·‖E_i(x_t)‖ and the number of those tokens (→ REAP's mean);
- ``reconstruction``: a set search over the tokens' reconstruction loss, on a bounded uniform
  sample of block inputs (at most ``max_tokens`` per layer; all of them when there are fewer);
- ``random``: nothing.

Sums are float64, so the streamed figures equal the all-at-once ones up to summation order.
The sample is a bottom-``max_tokens`` sample by a hash of each token's index in the calibration
set: the same tokens whatever the batch size, kept in their original order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moectl.adapters.inspect import MoELayer
from moectl.routing.keyed_hash import M32, mix
from moectl.subsets import methods
from moectl.subsets.experts import select

NEEDS: dict[str, frozenset[str]] = {
    "router": frozenset({"probs"}),
    "frequency": frozenset({"counts"}),
    "wanda": frozenset({"squares"}),
    "easy_ep": frozenset({"easy_ep"}),
    "reap": frozenset({"reap"}),
    "reconstruction": frozenset({"sample"}),
    "random": frozenset(),
}


def _hash(index: Tensor, seed: int) -> Tensor:
    """A 32-bit scramble of token indices (int64), for the uniform bottom-k sample."""
    return mix((index + seed * 0x9E3779B1) & M32)


@dataclass
class TokenSample:
    """At most ``limit`` block inputs ``x`` [N, H] (their original dtype) with their token indices."""

    limit: int | None
    seed: int = 0
    x: Tensor | None = None
    index: Tensor | None = None

    def add(self, x: Tensor, first: int) -> None:
        index = torch.arange(first, first + x.shape[0], device=x.device)
        if self.x is not None:
            assert self.index is not None
            x, index = torch.cat([self.x, x]), torch.cat([self.index, index])
        if self.limit is not None and x.shape[0] > self.limit:
            keep = _hash(index, self.seed).topk(self.limit, largest=False).indices.sort().values
            x, index = x[keep], index[keep]
        self.x, self.index = x, index


@dataclass
class LayerStats:
    """Running statistics of one MoE layer's calibration tokens (only those ``needs`` names).

    ``needs`` holds statistic names (``NEEDS``) and, for callers that want the tokens themselves,
    ``inputs``: every block input and residual stream (``sample`` and ``residual``, unbounded).
    """

    needs: frozenset[str]
    max_tokens: int | None = None
    seed: int = 0
    tokens: int = 0
    probs: Tensor | None = None  # [E] Σ_t p_t
    counts: Tensor | None = None  # [E] top-k memberships
    squares: Tensor | None = None  # [H] Σ_t x_t²
    easy_ep: Tensor | None = None  # [E] Easy-EP score sums
    reap: Tensor | None = None  # [2, E] REAP's weighted norm sums and routed-token counts
    sample: TokenSample | None = None  # block inputs: bounded ("sample") or all ("inputs")
    residual: TokenSample | None = None  # with "inputs": the residual stream of the same tokens

    @property
    def wants_residual(self) -> bool:
        return bool({"easy_ep", "inputs"} & self.needs)

    def update(self, layer: MoELayer, x: Tensor, logits: Tensor | None, residual: Tensor | None) -> None:
        """Add one batch's real tokens: block inputs ``x`` [N, H] (model dtype), router logits
        [N, E] float32, the residual stream [N, H] (or None: the block input itself)."""
        needs = self.needs
        residual = x if residual is None else residual
        if "probs" in needs:
            assert logits is not None
            self.probs = _add(self.probs, layer.rule.probs(logits).double().sum(0))
        if "counts" in needs:
            assert logits is not None
            _, idx = select(layer, logits)
            counts = torch.bincount(idx.reshape(-1).cpu(), minlength=layer.num_experts).double()
            self.counts = _add(self.counts, counts)
        if "squares" in needs:
            self.squares = _add(self.squares, x.double().pow(2).sum(0))
        if "easy_ep" in needs:
            self.easy_ep = _add(
                self.easy_ep, methods.easy_ep_scores(layer, x.float(), residual.float(), logits)
            )
        if "reap" in needs:
            self.reap = _add(self.reap, torch.stack(methods.reap_sums(layer, x.float(), logits)))
        if "sample" in needs or "inputs" in needs:
            limit = None if "inputs" in needs else self.max_tokens
            self.sample = self.sample or TokenSample(limit, self.seed)
            self.sample.add(x, self.tokens)
        if "inputs" in needs:
            self.residual = self.residual or TokenSample(None)
            self.residual.add(residual, self.tokens)
        self.tokens += x.shape[0]


def _add(total: Tensor | None, part: Tensor) -> Tensor:
    part = part.cpu()
    return part if total is None else total + part


def scores_of(layer: MoELayer, stats: LayerStats, method: str, seed: int = 0) -> Tensor:
    """Per-expert scores [E] (higher: keep) of the ranking methods from a layer's statistics."""
    n = max(stats.tokens, 1)
    if method == "router":
        assert stats.probs is not None
        return stats.probs / n
    if method == "frequency":
        assert stats.counts is not None
        return stats.counts / n
    if method == "wanda":
        assert stats.squares is not None
        return methods.wanda_from_norms(layer, stats.squares.sqrt())
    if method == "easy_ep":
        assert stats.easy_ep is not None
        return stats.easy_ep
    if method == "reap":
        assert stats.reap is not None
        return methods.reap_from_sums(stats.reap[0], stats.reap[1])
    if method == "random":
        return methods.random_scores(layer, torch.empty(0), seed)
    raise ValueError(f"{method} is not a ranking method")
