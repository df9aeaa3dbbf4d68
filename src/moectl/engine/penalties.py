"""What changes a request's logits before its next token is chosen: OpenAI's ``logit_bias``,
``presence_penalty`` and ``frequency_penalty``, and transformers' ``repetition_penalty``.

As OpenAI defines them, for each token j with c[j] = the times j was generated so far in this
completion: logit[j] += bias[j] − c[j] · frequency_penalty − (c[j] > 0) · presence_penalty.
``repetition_penalty`` p (the CTRL paper's, as transformers' ``RepetitionPenaltyLogitsProcessor``
and vLLM apply it): every token seen in the prompt or the completion gets logit / p where the
logit is positive and logit · p where it is negative. The order is vLLM's: the bias, then the
repetition penalty, then frequency and presence.

``min_tokens`` (vLLM's): until a request has that many tokens, its stop tokens cannot be chosen
(their scores set to −inf, as vLLM's ``MinTokensLogitsProcessor`` does) and its stop strings do not
count (``engine.text.TextStream``).

The requests of a step are handled together: one [R, V] count per step from the rows' generated
ids, R = the requests that ask for any of this (the others are not touched). The prompt's tokens
for ``repetition_penalty`` are kept per request as a [V] mask, built once. A request of K routed
copies or RoE is penalised on the distribution it samples from (the log of its copies' mean
probability, all negative: p then always lowers a seen token's score); the log-probabilities a
request reports are the model's, before any of this (vLLM's default, ``raw_logprobs``).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import Tensor

from moectl.errors import ConfigError

MAX_PENALTY = 2.0  # OpenAI's range for presence and frequency penalties: [-2, 2]
MAX_BIAS = 100.0  # OpenAI's range for a logit bias: [-100, 100]
MAX_BIASED_TOKENS = 300  # OpenAI's limit of logit_bias entries


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_penalties(params: Any) -> None:
    """``ConfigError`` naming the first of ``params``' penalties, bias, stop ids or ``min_tokens``
    out of range (and normalises ``logit_bias`` to (int id, float) pairs, ``stop_token_ids`` to a
    tuple)."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not (_number(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
            raise ConfigError(f"{name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
    if not (_number(params.repetition_penalty) and params.repetition_penalty > 0):
        raise ConfigError(f"repetition_penalty must be a number > 0 (1: off), got {params.repetition_penalty!r}")
    bias = params.logit_bias
    pairs = tuple(bias.items()) if isinstance(bias, dict) else tuple(bias)
    if len(pairs) > MAX_BIASED_TOKENS:
        raise ConfigError(f"logit_bias holds {len(pairs)} tokens; at most {MAX_BIASED_TOKENS}")
    clean = []
    for pair in pairs:
        token, value = pair if isinstance(pair, (tuple, list)) and len(pair) == 2 else (pair, None)
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ConfigError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
        if not (_number(value) and -MAX_BIAS <= value <= MAX_BIAS):
            raise ConfigError(f"logit_bias values must be numbers in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {value!r}")
        clean.append((int(token), float(value)))
    object.__setattr__(params, "logit_bias", tuple(clean))
    ids = params.stop_token_ids
    ids = (ids,) if isinstance(ids, int) and not isinstance(ids, bool) else tuple(ids)
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ConfigError(f"stop_token_ids must be token ids (integers >= 0), got {params.stop_token_ids!r}")
    object.__setattr__(params, "stop_token_ids", ids)
    m = params.min_tokens
    if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= params.max_tokens:
        raise ConfigError(f"min_tokens must be an integer from 0 to max_tokens ({params.max_tokens}), got {m!r}")


def check_bias_ids(params: Any, vocab: int) -> None:
    """``ConfigError`` for a biased or stop token id outside the vocabulary [0, ``vocab``)."""
    for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids)):
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise ConfigError(f"{name} token id {bad} is outside the vocabulary [0, {vocab})")


def prompt_mask(prompt: Sequence[int], vocab: int, device: torch.device) -> Tensor:
    """[V] True at the tokens of ``prompt`` (``repetition_penalty`` counts them as seen)."""
    mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    mask[torch.tensor(list(prompt), dtype=torch.long, device=device).clamp(max=vocab - 1)] = True
    return mask


def apply_penalties(
    logits: Tensor, params: Sequence[Any], generated: Sequence[Sequence[int]], prompts: Sequence[Tensor | None]
) -> Tensor:
    """``logits`` [R, V] (one row per request, float32) with each request's penalties and bias, for
    requests with ``params[i]`` (``SamplingParams``), its generated ids ``generated[i]`` and its
    prompt mask ``prompts[i]`` (``prompt_mask``; None where its repetition penalty is 1). Returns
    a new tensor; rows whose parameters ask for nothing are left as they were."""
    r, vocab = logits.shape
    dev = logits.device
    out = logits.float().clone()
    biased = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
    if biased:
        rows, tokens, values = zip(*biased, strict=True)
        out.index_put_(
            (torch.tensor(rows, device=dev), torch.tensor(tokens, device=dev)),
            torch.tensor(values, dtype=out.dtype, device=dev),
            accumulate=True,
        )
    repeat = any(p.repetition_penalty != 1.0 for p in params)
    additive = any(p.frequency_penalty or p.presence_penalty for p in params)
    if not (repeat or additive):
        return out
    knobs = torch.tensor(
        [[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params], dtype=torch.float32
    ).to(dev, non_blocking=True)
    counts = torch.zeros(r, vocab + 1, dtype=torch.float32, device=dev)  # column V: padding
    longest = max((len(g) for g in generated), default=0)
    if longest:
        ids = torch.tensor([[*g, *([vocab] * (longest - len(g)))] for g in generated], dtype=torch.long)
        counts.scatter_add_(1, ids.to(dev, non_blocking=True), torch.ones(ids.shape, dtype=torch.float32, device=dev))
    counts = counts[:, :vocab]
    generated_seen = counts > 0
    if repeat:
        seen = generated_seen.clone()
        masks = [m for m in prompts if m is not None]
        if masks:
            seen[[i for i, m in enumerate(prompts) if m is not None]] |= torch.stack(masks)
        penalty = knobs[:, :1]
        out = torch.where(seen, torch.where(out > 0, out / penalty, out * penalty), out)
    if additive:
        out -= counts * knobs[:, 1:2] + generated_seen * knobs[:, 2:3]
    return out


def penalise(scores: Tensor, reqs: Sequence[Any], eos_ids: Collection[int] = ()) -> Tensor:
    """``scores`` [N, V] (one row per request) with the penalties and bias of the requests whose
    ``params.penalised``; the others' rows as they were. A request's prompt mask is built at its
    first token and kept on it (``prompt_seen``). Before its ``min_tokens``, a request cannot
    choose its stop tokens: its ``stop_token_ids`` and, unless it ignores EOS, ``eos_ids``."""
    which = [i for i, r in enumerate(reqs) if r.params.penalised]
    if not which:
        return scores
    masks: list[Tensor | None] = []
    for i in which:
        req = reqs[i]
        if req.params.repetition_penalty != 1.0 and req.prompt_seen is None:
            req.prompt_seen = prompt_mask(req.prompt, scores.shape[-1], scores.device)
        masks.append(req.prompt_seen if req.params.repetition_penalty != 1.0 else None)
    chosen = [reqs[i] for i in which]
    args = ([r.params for r in chosen], [r.generated for r in chosen], masks)
    if len(which) == len(reqs):
        out = apply_penalties(scores, *args)
    else:
        index = torch.tensor(which, device=scores.device)
        out = scores.float().clone()
        out[index] = apply_penalties(scores[index], *args)
    banned = [
        (i, t)
        for i in which
        if len(reqs[i].generated) < reqs[i].params.min_tokens
        for t in {*reqs[i].params.stop_token_ids, *(() if reqs[i].params.ignore_eos else eos_ids)}
        if t < out.shape[-1]
    ]
    if banned:
        rows, tokens = zip(*banned, strict=True)
        out[torch.tensor(rows, device=out.device), torch.tensor(tokens, device=out.device)] = float("-inf")
    return out
