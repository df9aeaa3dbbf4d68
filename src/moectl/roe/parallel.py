"""RoE log-likelihoods of whole sequences without [K, T, V]: clean forward, noisy spans, running reductions.

p_RoE(x_t | x_<t) aggregates the K routing samples that predict x_t from the clean prefix (RoE
§2.3; ``prob_mean``, the paper's probability average, §3.1, or ``logprob_mean``). The samples
come span by span from ``spans.sample_spans`` as final hidden states; the LM head runs on a few
tokens at a time (``lm.lm_head``) and each result is folded into a running reduction at once:

- :func:`parallel_token_logprobs` — log p_RoE of each next token [B, T]: one log-probability per
  (sample, token), log-add-exp over the samples (``prob_mean``). Nothing of size V outlives a
  head call.
- :func:`parallel_token_scores` — the same plus whether each token is the RoE distribution's
  greedy choice (what evaluation needs): a [B, P, V] accumulator per span of P positions.
- :func:`parallel_log_probs` / :func:`ensemble_log_probs` — whole next-token distributions
  [B, T, V] for callers whose interface is full logits (an lm-eval harness's ``_model_call``):
  written span by span into the output; no [K, …] or second [B, T, V] buffer.

Generation needs the last position only: ``Ensemble`` (``ensemble.ensemble``) decodes with the clean
cache and asks the model for the last position's logits ([B, K, V]) at each step.
Models with recurrent layers (and ``cache != "clean"``) take the stepwise path: teacher-forced
``Ensemble`` steps, reduced step by step the same way.

Every function reads one :class:`RoEScoringInputs` (model, left-padded ``ids`` / ``mask``, RoE
config, model info, routing policies); ``Budget`` and ``greedy`` are how it computes, not what.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from moectl.ensemble.ensemble import Ensemble
from moectl.ensemble.roe_config import RoEConfig
from moectl.errors import ConfigError
from moectl.lm.lm_head import HEAD_BYTES, add_log_probs, head_rows, output_head, target_logprobs, vocab_size
from moectl.lm.scored_tokens import TokenScores
from moectl.roe.spans import RoEScoringInputs, is_attention_only, sample_spans

__all__ = [
    "Budget",
    "RoEScoringInputs",
    "TokenScores",
    "ensemble_log_probs",
    "ensemble_token_scores",
    "is_attention_only",
    "parallel_log_probs",
    "parallel_token_logprobs",
    "parallel_token_scores",
]


@dataclass(frozen=True)
class Budget:
    """Chunk sizes: float bytes of one LM-head call (``head_bytes``, also the cap of a span's
    [B, P, V] accumulator) and query tokens of one noisy forward (``span_tokens``; None: as many
    as keep its attention area within the clean forward's, ``spans.span_plan``)."""

    head_bytes: int = HEAD_BYTES
    span_tokens: int | None = None


def _finish(acc: Tensor, config: RoEConfig) -> Tensor:
    """The aggregated log-distribution from the running sums over the K samples (in place)."""
    if config.aggregation == "prob_mean":
        return acc.sub_(math.log(config.K))
    return torch.log_softmax(acc.div_(config.K), dim=-1)


def _check(config: RoEConfig) -> None:
    if config.aggregation not in ("prob_mean", "logprob_mean"):
        raise ConfigError(f"aggregation must be 'prob_mean' or 'logprob_mean', got {config.aggregation!r}")


def _distributions(inputs: RoEScoringInputs, positions: int, budget: Budget) -> Iterator[tuple[int, Tensor]]:
    """(first position, RoE log-distributions [B, P, V]) span by span, at positions 0 … positions − 1."""
    config = inputs.config
    head, rows = output_head(inputs.model), head_rows(vocab_size(inputs.model), budget.head_bytes)
    span_positions = max(1, rows // max(1, inputs.ids.shape[0]))  # the [B, P, V] accumulator ≤ one head call
    acc: Tensor | None = None
    for part in sample_spans(inputs, positions, span_positions, budget.span_tokens):
        for k in range(part.hidden.shape[1]):  # the samples of this group, one head pass each
            acc = add_log_probs(head, part.hidden[:, k], acc, config.aggregation, rows)
        if part.last:
            assert acc is not None
            yield part.first, _finish(acc, config)
            acc = None


@torch.no_grad()
def parallel_token_logprobs(inputs: RoEScoringInputs, budget: Budget = Budget()) -> Tensor:
    """RoE log p(x_t | x_<t) [B, T] of a left-padded batch (0 at position 0 and at padding).

    Attention-only models, clean cache. ``prob_mean`` keeps one number per (sample, token);
    ``logprob_mean`` needs each position's normaliser over the vocabulary, so it goes through
    span accumulators as :func:`parallel_token_scores` does.
    """
    config, ids = inputs.config, inputs.ids
    _check(config)
    if config.aggregation != "prob_mean":
        return parallel_token_scores(inputs, False, budget).logprob
    b, length = ids.shape
    head, rows = output_head(inputs.model), head_rows(vocab_size(inputs.model), budget.head_bytes)
    acc = torch.full((b, length), -math.inf, device=ids.device)
    for part in sample_spans(inputs, length - 1, None, budget.span_tokens):
        c, span = part.hidden.shape[1], part.hidden.shape[2]
        targets = ids[:, part.first + 1 : part.stop + 1, None].expand(b, span, c).transpose(1, 2)
        lp = target_logprobs(head, part.hidden.reshape(b * c * span, -1), targets.reshape(-1), rows)
        lp = torch.logsumexp(lp.reshape(b, c, span), dim=1)
        if lp.dtype != acc.dtype:
            acc = acc.to(lp.dtype)
        window = acc[:, part.first + 1 : part.stop + 1]
        torch.logaddexp(window, lp, out=window)
    zero = torch.zeros(1, dtype=torch.long, device=ids.device)
    return (acc - math.log(config.K)).masked_fill_(~inputs.mask.bool(), 0.0).index_fill_(1, zero, 0.0)


class _TokenScoresOut:
    """The [B, T] outputs of :class:`TokenScores` filled position by position, then finished at padding."""

    def __init__(self, ids: Tensor, greedy: bool) -> None:
        b, length = ids.shape
        self.logprob = torch.zeros(b, length, device=ids.device)
        self.flags = torch.ones(b, length, dtype=torch.bool, device=ids.device) if greedy else None

    def put(self, at: slice | int, dist: Tensor, target: Tensor) -> None:
        """Log-probability of ``target`` under the log-distributions ``dist`` [B, (P,) V], and whether it is greedy."""
        lp = dist.gather(-1, target[..., None]).squeeze(-1)
        if lp.dtype != self.logprob.dtype:
            self.logprob = self.logprob.to(lp.dtype)
        self.logprob[:, at] = lp
        if self.flags is not None:
            self.flags[:, at] = dist.argmax(-1) == target

    def done(self, mask: Tensor) -> TokenScores:
        valid = mask.bool()
        self.logprob.masked_fill_(~valid, 0.0)
        if self.flags is not None:
            self.flags |= ~valid
        return TokenScores(self.logprob, self.flags)


@torch.no_grad()
def parallel_token_scores(
    inputs: RoEScoringInputs, greedy: bool = True, budget: Budget = Budget()
) -> TokenScores:
    """:class:`TokenScores` of a left-padded batch, span by span (attention-only models, clean cache)."""
    _check(inputs.config)
    ids = inputs.ids
    out = _TokenScoresOut(ids, greedy)
    for first, dist in _distributions(inputs, ids.shape[1] - 1, budget):
        stop = first + dist.shape[1]
        out.put(slice(first + 1, stop + 1), dist, ids[:, first + 1 : stop + 1])
        del dist
    return out.done(inputs.mask)


@torch.no_grad()
def parallel_log_probs(inputs: RoEScoringInputs, budget: Budget = Budget()) -> Tensor:
    """RoE next-token log-probabilities [B, T, V] at every position (the output is the only
    vocabulary-sized buffer that lasts: span accumulators are written into it and dropped)."""
    _check(inputs.config)
    out: Tensor | None = None
    for first, dist in _distributions(inputs, inputs.ids.shape[1], budget):
        if out is None:
            out = torch.empty((*inputs.ids.shape, dist.shape[-1]), dtype=dist.dtype, device=dist.device)
        out[:, first : first + dist.shape[1]] = dist
        del dist
    assert out is not None
    return out


def _parallel(inputs: RoEScoringInputs) -> bool:
    """Whether the span path serves ``inputs`` (clean cache, attention-only model)."""
    return inputs.config.cache == "clean" and is_attention_only(inputs.model)


def ensemble_log_probs(inputs: RoEScoringInputs) -> Tensor:
    """RoE next-token log-probabilities [B, L, V] (float32) at every position of a left-padded batch.

    Position t holds log p_RoE(· | x_≤t), aggregated over the K samples as ``config.aggregation``
    says (``prob_mean``: the paper's probability average, §3.1). Attention-only models use the
    clean-cache span path; others (and ``cache != "clean"``) decode teacher-forced with
    ``Ensemble``, one step per position. Callers that only need the log-probability of the next
    token (and whether it is the greedy one) should use :func:`ensemble_token_scores`.
    """
    if _parallel(inputs):
        return parallel_log_probs(inputs)
    return _stepwise_log_probs(inputs)


def ensemble_token_scores(inputs: RoEScoringInputs, greedy: bool = True) -> TokenScores:
    """:class:`TokenScores` under RoE for any model and cache variant, without [B, T, V]."""
    if _parallel(inputs):
        if not greedy and inputs.config.aggregation == "prob_mean":
            return TokenScores(parallel_token_logprobs(inputs))
        return parallel_token_scores(inputs, greedy)
    ids = inputs.ids
    out = _TokenScoresOut(ids, greedy)
    for t, step in enumerate(_steps(inputs, ids.shape[1] - 1), 1):
        out.put(t, step.logprobs, ids[:, t])
    return out.done(inputs.mask)


def _steps(inputs: RoEScoringInputs, length: int):
    """Teacher-forced ``Ensemble`` steps over the first ``length`` positions: the distribution after
    each (any cache variant)."""
    if length < 1:
        return
    ids, mask = inputs.ids, inputs.mask
    valid = mask.bool()
    with (
        torch.no_grad(),
        Ensemble(inputs.model, inputs.config, info=inputs.info, policies=inputs.policies) as ens,
    ):
        yield ens.start(ids[:, :1], mask[:, :1])
        for t in range(1, length):  # one ensemble step per position: the definition, not a hot path
            yield ens.step(ids[:, t], valid[:, t])


def _stepwise_log_probs(inputs: RoEScoringInputs) -> Tensor:
    """Teacher-forced ``Ensemble`` steps stacked: [B, L, V] (the definition the span path must equal)."""
    return torch.stack([s.logprobs for s in _steps(inputs, inputs.ids.shape[1])], dim=1)
