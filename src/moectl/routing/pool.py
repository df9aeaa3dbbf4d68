"""DocumentPool: route every token of a document within a shared pool of d experts (EMO §3.2).

D = Top-d((1/T) Σ_t p_t) over the document's tokens; routing is then restricted to D and p is
renormalised over it (p-hat), i.e. the "pruned" mode of ``ExpertMask``. Two modes:

- ``"full"`` (EMO's training definition): the mean runs over the whole document, future tokens
  included. In generation, "the whole document" is everything seen so far.
- ``"causal"`` (beyond the paper, usable in generation): the pool at position t is computed from
  tokens 0..t of its document, so no token's routing depends on later tokens.

Documents are the rows of the batch, or — with ``doc_ids`` [B, T] — the runs of equal ids in a
packed row. Padding tokens (from the attention mask) are excluded from the means. Sums are
vectorised segment reductions (cumsum / scatter-add), no loop over documents, accumulated in
float64: a float32 prefix sum over a 16k-token packed row loses ~1e-5 of a short document's mean
when the prefix before it is subtracted, enough to swap two experts of nearly equal mean. Across
decoding steps the per-row sums are carried; a call at offset 0 starts new documents.

Grouped routers (DeepSeek-V3 §2.1.2 group-limited routing, GLM-4-MoE, dots1: ``topk_group`` of
``n_group`` groups): EMO defines the pool for routers without groups, and a top-d pool spread over
more groups than the router keeps could leave a token fewer than top-k reachable experts.
Deviation: on such a layer the pool is the top-d of the mean *within the document's best
``topk_group`` groups* (groups scored as the router scores them: the sum of their two best
means), so every pooled expert stays reachable; ``bind`` refuses d > topk_group · E / n_group.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo
from moectl.adapters.rules import RouterRule
from moectl.errors import ConfigError
from moectl.routing.policy_config import PolicyConfig, register_policy
from moectl.routing.routing_state import RoutingState

PoolMode = Literal["causal", "full"]


def _acc_dtype(device: torch.device) -> torch.dtype:
    """float64 for the segment sums (exact means), except where the device has none (MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


def segment_starts(doc_ids: Tensor) -> Tensor:
    """For each position of [B, T] doc ids, the index where its run of equal ids starts."""
    b, t = doc_ids.shape
    pos = torch.arange(t, device=doc_ids.device).expand(b, t)
    boundary = torch.ones_like(doc_ids, dtype=torch.bool)
    boundary[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return torch.where(boundary, pos, torch.zeros_like(pos)).cummax(dim=1).values


def prefix_means(p: Tensor, valid: Tensor, doc_ids: Tensor | None) -> tuple[Tensor, Tensor]:
    """Causal per-document sums and counts of p [B, T, E] over valid tokens up to each t (float64)."""
    p = p.to(_acc_dtype(p.device))
    w = valid.to(p.dtype).unsqueeze(-1)
    csum = torch.cumsum(p * w, dim=1)
    ccount = torch.cumsum(w, dim=1)
    if doc_ids is not None:
        starts = segment_starts(doc_ids)
        prev_sum = torch.nn.functional.pad(csum, (0, 0, 1, 0))[:, :-1]
        prev_count = torch.nn.functional.pad(ccount, (0, 0, 1, 0))[:, :-1]
        idx = starts.unsqueeze(-1)
        csum = csum - prev_sum.gather(1, idx.expand_as(csum))
        ccount = ccount - prev_count.gather(1, idx)
    return csum, ccount


def full_means(p: Tensor, valid: Tensor, doc_ids: Tensor | None) -> tuple[Tensor, Tensor]:
    """Whole-document sums and counts of p [B, T, E], broadcast back to every token (float64)."""
    p = p.to(_acc_dtype(p.device))
    w = valid.to(p.dtype).unsqueeze(-1)
    if doc_ids is None:
        total = (p * w).sum(1, keepdim=True).expand_as(p)
        return total, w.sum(1, keepdim=True).expand(*p.shape[:2], 1)
    seg = segment_starts(doc_ids)  # run start index: a per-row segment id in 0..T-1
    b, t, e = p.shape
    sums = torch.zeros(b, t, e, dtype=p.dtype, device=p.device).scatter_add_(
        1, seg.unsqueeze(-1).expand(b, t, e), p * w
    )
    counts = torch.zeros(b, t, 1, dtype=p.dtype, device=p.device).scatter_add_(1, seg.unsqueeze(-1), w)
    return sums.gather(1, seg.unsqueeze(-1).expand(b, t, e)), counts.gather(1, seg.unsqueeze(-1))


def group_limited(mean: Tensor, rule: RouterRule) -> Tensor:
    """``mean`` [B, T, E] with the experts outside its best ``topk_group`` groups set below any mean.

    Groups are scored as the router scores them (the sum of each group's two best values).
    """
    *lead, e = mean.shape
    grouped = mean.reshape(*lead, rule.n_group, e // rule.n_group)
    score = grouped.topk(min(2, e // rule.n_group), dim=-1).values.sum(-1)
    best = score.topk(rule.topk_group, dim=-1).indices
    keep = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, best, True)
    keep = keep.unsqueeze(-1).expand_as(grouped).reshape(mean.shape)
    return mean.masked_fill(~keep, -2.0)


@register_policy("document_pool")
class DocumentPool(PolicyConfig):
    """Restrict each document's tokens to the top-d experts of its mean routing distribution.

    As a config: ``{"type": "document_pool", "format_version": 1, "d": 4, "mode": "causal"}``
    (a per-token ``d`` tensor and ``doc_ids`` belong to one batch and are not written).
    """

    def __init__(self, d: int | Tensor, mode: PoolMode = "causal", doc_ids: Tensor | None = None) -> None:
        """``d`` is one pool size, or a [B, T] tensor of per-token sizes (constant within a document,
        as EMO §3.3 samples d ~ U{k, ..., n_r} per document: see ``sample_pool_sizes``)."""
        if mode not in ("causal", "full"):
            raise ConfigError(f"DocumentPool mode must be 'causal' or 'full', got {mode!r}")
        self.d = d if isinstance(d, Tensor) else int(d)
        self.mode: PoolMode = mode
        self.doc_ids = doc_ids
        self._carry: dict[int, tuple[Tensor, Tensor]] = {}

    def __repr__(self) -> str:
        d = "per-token" if isinstance(self.d, Tensor) else self.d
        return f"DocumentPool(d={d}, mode={self.mode!r}{', packed' if self.doc_ids is not None else ''})"

    # -- config -------------------------------------------------------------------------------
    def config_fields(self) -> dict[str, Any]:
        if isinstance(self.d, Tensor) or self.doc_ids is not None:
            raise ConfigError(
                "DocumentPool: a per-token d tensor or doc_ids describe one batch, not a policy file; "
                "only DocumentPool(d: int, mode) is written"
            )
        return {"d": self.d, "mode": self.mode}

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], info: ModelInfo | None = None, *, model: nn.Module | None = None
    ) -> DocumentPool:
        d = data.get("d")
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise ConfigError(f"a document_pool needs 'd', the pool size (an integer >= 1), got {d!r}")
        return cls(d, mode=data.get("mode", "causal"))

    # -- policy ---------------------------------------------------------------------------------
    def fork(self, seed: int) -> DocumentPool:
        """The same pool size with no running means (``SequencePolicy``; ``seed`` is unused: no draws)."""
        return DocumentPool(self.d, self.mode, self.doc_ids)

    def bind(self, info: ModelInfo) -> None:
        lo, hi = (int(self.d.min()), int(self.d.max())) if isinstance(self.d, Tensor) else (self.d, self.d)
        for layer in info.layers:
            rule = layer.rule
            top = (rule.topk_group * layer.num_experts // rule.n_group) if rule.grouped else layer.num_experts
            if not (layer.top_k <= lo and hi <= top):
                what = f"top-k <= d <= {'topk_group * E / n_group' if rule.grouped else 'E'}"
                groups = (
                    f", the router keeps {rule.topk_group} of {rule.n_group} expert groups" if rule.grouped else ""
                )
                raise ConfigError(
                    f"DocumentPool: pool size d={self.d if lo == hi else f'{lo}..{hi}'} must satisfy {what}; "
                    f"MoE layer {layer.index} has top-k={layer.top_k}, E={layer.num_experts}{groups} "
                    f"(allowed d: {layer.top_k}..{top})"
                )
        self._carry = {}

    def apply(self, state: RoutingState) -> None:
        ctx = state.ctx
        probs = state.probs.detach()  # the pool is a discrete choice: no gradient through it
        p = probs if state.allowed is None else probs * state.allowed
        valid = ctx.valid_mask(p.device)
        doc_ids = self.doc_ids
        if doc_ids is not None:
            if ctx.offset > 0:
                raise ConfigError(
                    "DocumentPool with doc_ids covers one forward over packed rows, not decoding steps"
                )
            if doc_ids.shape != p.shape[:2]:
                raise ConfigError(
                    f"DocumentPool: doc_ids shape {tuple(doc_ids.shape)} != batch shape {tuple(p.shape[:2])}"
                )
            doc_ids = doc_ids.to(p.device)
        sums, counts = (prefix_means if self.mode == "causal" else full_means)(p, valid, doc_ids)
        if ctx.offset > 0 and state.layer in self._carry:
            carry_sum, carry_count = self._carry[state.layer]
            sums = sums + carry_sum[:, None, :]
            counts = counts + carry_count[:, None, :]
        if doc_ids is None:
            self._carry[state.layer] = (sums[:, -1].detach(), counts[:, -1].detach())
        mean = sums / counts.clamp(min=1)  # float64: the ranking sees the exact means
        if state.allowed is not None:
            mean = mean.masked_fill(~state.allowed, -1.0)
        if state.rule.grouped:
            mean = group_limited(mean, state.rule)
        if isinstance(self.d, Tensor):
            if self.d.shape != mean.shape[:2]:
                raise ConfigError(
                    f"DocumentPool: per-token d has shape {tuple(self.d.shape)}, batch is {tuple(mean.shape[:2])}"
                )
            rank = mean.argsort(-1, descending=True).argsort(-1)
            pool = rank < self.d.to(mean.device).unsqueeze(-1)
        else:
            pool_idx = mean.topk(self.d, dim=-1).indices
            pool = torch.zeros_like(mean, dtype=torch.bool).scatter_(-1, pool_idx, True)
        state.restrict(pool, "pruned")
        state.extras.setdefault("pool", pool)


def sample_pool_sizes(doc_ids: Tensor, k: int, n_r: int, generator: torch.Generator | None = None) -> Tensor:
    """Per-token pool sizes with d ~ U{k, ..., n_r} drawn once per document (EMO §3.3, A.2)."""
    if not 1 <= k <= n_r:
        raise ConfigError(f"pool sizes need 1 <= k <= n_r, got k={k}, n_r={n_r}")
    draws = torch.randint(k, n_r + 1, doc_ids.shape, generator=generator, device="cpu").to(doc_ids.device)
    return draws.gather(1, segment_starts(doc_ids))
