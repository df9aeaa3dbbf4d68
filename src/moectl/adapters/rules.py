"""Router selection rules: recompute (weights, indices) from a router's raw logits.

Every supported router family is one of a few rules, parameterised by what it reads off the
router module (top-k, renormalisation, score-correction bias, expert groups, scaling):

- ``softmax_topk``: p = softmax(g); top-k of p (+ bias), optionally restricted to the best expert
  groups; weights p[idx], optionally renormalised, times a scaling factor (OLMoE, Mixtral,
  Qwen2/3-MoE, Qwen3-Next, MiniMax, Ernie-4.5, Jamba, FlexOlmo, DeepSeek-V2, EMO's routed experts).
- ``topk_softmax``: top-k of g; weights softmax(g[idx]) (gpt-oss, Granite-MoE).
- ``sigmoid_topk``: s = sigmoid(g); top-k of s + bias, optionally restricted to the best expert
  groups; weights s[idx], optionally renormalised, times a scaling factor (DeepSeek-V3, GLM4-MoE,
  dots1).
- ``sigmoid_dense``: top-k of g; weights sigmoid(g[idx]) scattered into a dense [N, E] matrix
  (Llama 4).
- ``sparsemixer``: Phi-MoE's inference rule, two experts picked one after the other, each weighted
  by a softmax over the experts within a jitter threshold of it (``adapters/sparsemixer.py``).

Policies contribute two things to a selection, never the selection itself: an ``allowed`` mask
and additive ``noise`` on the logits used for choosing (RoE §2.1: weights come from the
un-noised scores). The mask is applied after any score-correction bias (docs/architecture.md, "Hook invariants"), with a large
finite negative rather than -inf so that no row can become NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from moectl.errors import ConfigError

RuleKind = Literal["softmax_topk", "topk_softmax", "sigmoid_topk", "sigmoid_dense", "sparsemixer"]
Renorm = Literal["pruned", "stock"]

MASKED = -1.0e4  # added to the choice score of a disallowed expert (finite: no NaN rows)
FORCED = 1.0e5  # added to the choice score of a forced expert: chosen before any other


@dataclass(frozen=True)
class RouterRule:
    """A router family's selection rule with the values read off one router module."""

    kind: RuleKind
    top_k: int
    num_experts: int
    norm_topk_prob: bool = False
    renorm_eps: float = 0.0  # added to the renormalisation denominator
    renorm_min: float = 0.0  # clamp of the denominator from below (Ernie's moe_norm_min)
    scaling: float = 1.0  # routed_scaling_factor
    n_group: int = 1
    topk_group: int = 1
    group_topn: int = 2  # a group's score sums its best group_topn: DeepSeek-V3 2, DeepSeek-V2 1 (its max)
    jitter_eps: float = 0.0  # sparsemixer's router_jitter_noise (Phi-MoE)
    threshold_dtype: str = "float32"  # dtype sparsemixer's threshold is decided in: the router's (Phi-MoE)

    @property
    def grouped(self) -> bool:
        return self.n_group > 1 and self.topk_group < self.n_group

    def probs(self, logits: Tensor) -> Tensor:
        """The routing distribution p (TE-MoE §2.2, EMO §3.1) over experts, float32.

        Softmax for softmax and top-k→softmax routers; for sigmoid routers the normalised
        sigmoid scores (deviation: these routers define no distribution; this keeps the order).
        """
        logits = logits.float()
        if self.kind in ("softmax_topk", "topk_softmax", "sparsemixer"):
            return torch.softmax(logits, dim=-1)
        scores = torch.sigmoid(logits)
        return scores / scores.sum(-1, keepdim=True)

    def select(
        self,
        logits: Tensor,
        bias: Tensor | None = None,
        allowed: Tensor | None = None,
        noise: Tensor | None = None,
        renorm: Renorm = "pruned",
        forced: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Return (weights [N, k] float32, indices [N, k] int64) for logits [N, E].

        ``allowed`` is a bool mask broadcastable to [N, E]; ``noise`` is added to the logits used
        for choosing only. ``renorm='pruned'`` renormalises p over the allowed experts before the
        stock rule (equals physically pruning the other experts); ``'stock'`` keeps the full p
        and only restricts the choice. ``forced`` (bool, broadcastable to [N, E]; at most k per row,
        all allowed) are chosen first, the rest of the k by the rule; weights stay the rule's.
        """
        logits = logits.float()
        choose_logits = logits if noise is None else logits + noise
        if self.kind in ("softmax_topk",):
            pruned = allowed is not None and renorm == "pruned"
            # pruned: softmax over the allowed logits (not p renormalised: p may underflow to 0 there)
            p = _softmax_over(logits, allowed) if pruned else torch.softmax(logits, dim=-1)
            if noise is None:
                choice = p
            else:
                choice = _softmax_over(choose_logits, allowed) if pruned else torch.softmax(choose_logits, dim=-1)
            if bias is not None:
                choice = choice + bias
            if self.grouped:
                choice = self._restrict_to_groups(choice, allowed)
            idx = _topk_masked(choice, allowed, self.top_k, forced)
            weights = p.gather(-1, idx)
            if self.norm_topk_prob and allowed is not None and not pruned and self.renorm_min == 0:
                # stock rule restricted to allowed experts: p[idx] / Σ p[idx] computed as a softmax over
                # the chosen logits, equal in exact arithmetic and finite when those p underflow
                weights = torch.softmax(logits.gather(-1, idx), dim=-1)
            elif self.norm_topk_prob:
                weights = weights / (weights.sum(-1, keepdim=True) + self.renorm_eps).clamp(
                    min=self.renorm_min
                )
            return weights * self.scaling, idx
        if self.kind == "topk_softmax":
            idx = _topk_masked(choose_logits, allowed, self.top_k, forced)
            return torch.softmax(logits.gather(-1, idx), dim=-1), idx
        if self.kind == "sigmoid_topk":
            scores = torch.sigmoid(logits)
            choice = scores if noise is None else torch.sigmoid(choose_logits)
            if bias is not None:
                choice = choice + bias
            if self.grouped:
                choice = self._restrict_to_groups(choice, allowed)
            idx = _topk_masked(choice, allowed, self.top_k, forced)
            weights = scores.gather(-1, idx)
            if self.norm_topk_prob:
                weights = weights / (weights.sum(-1, keepdim=True) + self.renorm_eps)
            return weights * self.scaling, idx
        if self.kind == "sigmoid_dense":
            idx = _topk_masked(choose_logits, allowed, self.top_k, forced)
            return torch.sigmoid(logits.gather(-1, idx)), idx
        if self.kind == "sparsemixer":
            if forced is not None:
                raise ConfigError("forcing experts is not supported for Phi-MoE's sparsemixer router")
            from moectl.adapters.sparsemixer import sparsemixer  # it imports MASKED from here

            dtype = getattr(torch, self.threshold_dtype)
            return sparsemixer(logits, self.jitter_eps, allowed, noise, renorm, dtype)
        raise ValueError(f"unknown rule kind {self.kind!r}")

    def weights_of(self, logits: Tensor, idx: Tensor, live: Tensor | None = None) -> Tensor:
        """The weights [N, k] float32 this rule gives the experts ``idx`` [N, k] (int64) chosen from
        ``logits`` [N, E]: what :meth:`select` returns beside the same indices, the choice itself
        taken as given (a replayed routing: ``routing/replay.py``). ``live`` [N, k] bool marks the
        slots in use; the others weigh 0 and leave the renormalisation (narrower records)."""
        logits = logits.float()
        if self.kind == "sparsemixer":
            raise ConfigError("replaying experts is not supported for Phi-MoE's sparsemixer router")
        if self.kind in ("topk_softmax",):
            chosen = logits.gather(-1, idx)
            if live is not None:
                chosen = chosen.masked_fill(~live, float("-inf"))
            return torch.softmax(chosen, dim=-1)
        if self.kind == "sigmoid_dense":
            weights = torch.sigmoid(logits.gather(-1, idx))
            return weights if live is None else weights * live
        scores = torch.softmax(logits, dim=-1) if self.kind == "softmax_topk" else torch.sigmoid(logits)
        weights = scores.gather(-1, idx)
        if live is not None:
            weights = weights * live
        if self.norm_topk_prob:
            total = weights.sum(-1, keepdim=True) + self.renorm_eps
            weights = weights / (total.clamp(min=self.renorm_min) if self.kind == "softmax_topk" else total)
        return weights * self.scaling

    def _restrict_to_groups(self, choice: Tensor, allowed: Tensor | None) -> Tensor:
        """Keep the ``topk_group`` best groups, scored by the sum of each group's ``group_topn`` best
        choice scores (DeepSeek-V3: two; DeepSeek-V2's group_limited_greedy: one, the group max)."""
        if allowed is not None:
            choice = choice.masked_fill(~allowed, MASKED)
        n = choice.shape[-1]
        grouped = choice.view(*choice.shape[:-1], self.n_group, n // self.n_group)
        group_scores = grouped.topk(min(self.group_topn, n // self.n_group), dim=-1).values.sum(-1)
        group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, group_idx, True)
        keep = keep.unsqueeze(-1).expand_as(grouped).reshape(choice.shape)
        return choice.masked_fill(~keep, 2 * MASKED)

    def check_allowed(self, allowed: Tensor, where: str = "mask") -> None:
        """Refuse an allowed-mask that leaves a token fewer than top-k reachable experts.

        For grouped routers the experts must be reachable after group selection: with masked
        experts scoring ``MASKED``, a group's score falls by ``MASKED`` for each of its
        ``group_topn`` best that is masked, so (for DeepSeek-V3's two) groups with two or more
        allowed experts always beat groups with one, which beat groups with none; the worst case
        over score orders must still offer top-k allowed experts.
        """
        if allowed.dtype != torch.bool:
            raise TypeError(f"{where}: allowed-expert mask must be bool, got {allowed.dtype}")
        if allowed.shape[-1] != self.num_experts:
            raise ConfigError(
                f"{where}: last dimension is {allowed.shape[-1]}, the layer has {self.num_experts} experts"
            )
        counts = allowed.sum(-1)
        if bool((counts < self.top_k).any()):
            raise ConfigError(
                f"{where}: allows only {int(counts.min())} experts for some token, fewer than top-k = "
                f"{self.top_k}; a mask must allow at least top-k experts"
            )
        if self.grouped:
            worst = _worst_case_reachable(allowed, self.n_group, self.topk_group, self.group_topn)
            if bool((worst < self.top_k).any()):
                raise ConfigError(
                    f"{where}: with {self.n_group} expert groups of which the router keeps "
                    f"{self.topk_group}, only {int(worst.min())} allowed experts are surely reachable, "
                    f"fewer than top-k = {self.top_k}; allow at least top-k experts within the "
                    f"{self.topk_group} groups that hold the most allowed experts"
                )


def _softmax_over(logits: Tensor, allowed: Tensor) -> Tensor:
    """Softmax over the allowed logits only (the distribution of a physically pruned router)."""
    return torch.softmax(logits.masked_fill(~allowed, torch.finfo(logits.dtype).min), dim=-1)


def _topk_masked(choice: Tensor, allowed: Tensor | None, k: int, forced: Tensor | None = None) -> Tensor:
    if allowed is not None:
        choice = choice.masked_fill(~allowed, MASKED)
    if forced is not None:
        choice = choice + forced.to(choice.dtype) * FORCED
    return choice.topk(k, dim=-1).indices


def _worst_case_reachable(allowed: Tensor, n_group: int, topk_group: int, topn: int = 2) -> Tensor:
    """Fewest allowed experts inside the kept groups, over all score orders consistent with tiers."""
    per_group = allowed.reshape(-1, n_group, allowed.shape[-1] // n_group).sum(-1)
    tier = per_group.clamp(max=topn)
    # Sort groups by tier (desc) then by allowed count (asc): the router picks by tier first, then
    # by scores we do not control, so the worst case takes the fewest-count groups within a tier.
    key = tier * (allowed.shape[-1] + 1) - per_group
    order = key.argsort(dim=-1, descending=True)
    kept = per_group.gather(-1, order[:, :topk_group])
    return kept.sum(-1)
