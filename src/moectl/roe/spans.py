"""The K routing samples of every position, span by span, over one clean KV cache (RoE §2.3).

With the clean cache, sample k's prediction at position t reads the *clean* keys and values of
x_<t and routes only x_t with noise. So one clean forward over the whole sequence fills a KV
cache (and gives sample 0, the clean path), and the noisy samples 1 … K−1 of a span of positions
run as extra queries of the same sequence: ``copies`` samples × P positions folded into the query
dimension (as a clean-cache decoding step folds the K samples of one token), each query seeing
the clean keys before its position and its own key only (``ensemble.masks.teacher_forced_span_masks``).
The cache is read, never repeated per sample, and nothing is appended to it.

:func:`sample_spans` yields final hidden states (after the model's last norm), not logits: the
callers run the LM head on a few tokens at a time (``lm.lm_head``). Its memory is the clean
forward's (activations at T tokens, the KV cache, one [B, T, H] hidden state) plus one noisy
forward of at most ``span_tokens`` query tokens, whose attention area Q · (n + Q) is kept within
the clean forward's T · T.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo, inspect
from moectl.ensemble.clean_cache import CleanCacheMixin, StepPlan, full_clean_cache
from moectl.ensemble.ensemble import experts_implementation
from moectl.ensemble.masks import AttentionKind, attention_kinds, mask_dtype, teacher_forced_span_masks
from moectl.ensemble.noise import NoiseLayout, SampleGumbel
from moectl.ensemble.roe_config import RoEConfig
from moectl.errors import UnsupportedModelError
from moectl.lm.final_hidden import decoder_of, final_hidden
from moectl.lm.padding import left_padded
from moectl.routing.kv_cache import with_cache
from moectl.routing.routing_state import Policy
from moectl.routing.session import route


def is_attention_only(model: nn.Module) -> bool:
    """True when every layer is attention (the span path needs a KV cache it can share)."""
    return not any(k.kind == "recurrent" for k in attention_kinds(model.config)[0])


@dataclass
class SampleSpan:
    """Final hidden states [B, c, P, H] of samples ``sample … sample + c − 1`` at positions
    ``first … first + P − 1``; ``last`` marks the span's final group of samples."""

    first: int
    sample: int
    hidden: Tensor
    last: bool

    @property
    def stop(self) -> int:
        return self.first + self.hidden.shape[2]


def span_plan(length: int, positions: int, K: int, span_tokens: int | None = None) -> tuple[int, int]:
    """(positions per span P, samples per noisy forward c) for ``positions`` scored positions.

    A noisy forward has Q = c · P query tokens over about ``length`` clean keys; by default Q is
    the largest with Q · (length + Q) ≤ length² (the clean forward's attention area), so a noisy
    forward never holds more activations than the clean one. ``span_tokens`` caps Q instead.
    """
    noisy = K - 1
    if span_tokens is None:
        span_tokens = int(length * (math.sqrt(5) - 1) / 2)  # q (length + q) = length²
    span_tokens = max(1, span_tokens)
    if noisy <= 0:
        return max(1, positions), 0
    copies = min(noisy, span_tokens)
    return max(1, min(positions, span_tokens // copies)), copies


@dataclass(frozen=True)
class RoEScoringInputs:
    """What every RoE scorer of whole sequences reads (this module, ``parallel``): the ``model``, a
    left-padded batch ``ids`` / ``mask`` [B, T], the RoE ``config``, the model's ``info`` (None:
    inspected) and routing ``policies`` applied before the noise (a mask, a subset), as in ``Ensemble``."""

    model: nn.Module
    ids: Tensor
    mask: Tensor
    config: RoEConfig
    info: ModelInfo | None = None
    policies: Sequence[Policy] = ()


@torch.no_grad()
def sample_spans(
    inputs: RoEScoringInputs,
    positions: int | None = None,
    span_positions: int | None = None,
    span_tokens: int | None = None,
) -> Iterator[SampleSpan]:
    """Hidden states of the K routing samples at positions 0 … ``positions`` − 1 of a left-padded batch.

    Per span of positions: the clean sample 0 first, then the noisy samples in groups (``last``
    on the final group). ``span_positions`` caps P (callers holding [B, P, V] accumulators);
    ``span_tokens`` caps the query tokens of a noisy forward (see :func:`span_plan`).
    """
    model, ids, mask, config, policies = inputs.model, inputs.ids, inputs.mask, inputs.config, inputs.policies
    info = inputs.info or inspect(model)
    if not is_attention_only(model):
        raise UnsupportedModelError("the parallel RoE path needs an attention-only model; use the stepwise path")
    b, length = ids.shape
    positions = length if positions is None else positions
    if positions <= 0:
        return
    seq = _Sequence.of(model, ids, mask)
    span, copies = span_plan(length, positions, config.K, span_tokens)
    if span_positions is not None:
        span = max(1, min(span, span_positions))
    noise = SampleGumbel(config.taus(info.num_moe_layers), seed=config.seed)
    decoder = decoder_of(model)
    cache = full_clean_cache(model)
    with experts_implementation(model, "grouped_mm"), route(model, [*policies, noise], info=info):
        clean = final_hidden(
            model, decoder,
            input_ids=ids, attention_mask=mask, position_ids=seq.position, **with_cache(cache), use_cache=True,
        )  # fmt: skip
        for first in range(0, positions, span):  # spans of positions: a few per sequence
            stop = min(first + span, positions)
            yield SampleSpan(first, 0, clean[:, None, first:stop], last=config.K == 1)
            for sample in range(1, config.K, max(1, copies)):
                c = min(copies, config.K - sample)
                hidden = _noisy(model, decoder, cache, noise, seq, first, stop, sample, c)
                yield SampleSpan(
                    first, sample, hidden.reshape(b, c, stop - first, -1), sample + c >= config.K
                )


@dataclass(frozen=True)
class _Sequence:
    """A left-padded batch as the noisy forwards need it."""

    ids: Tensor
    valid: Tensor
    left_pad: Tensor
    position: Tensor
    kinds: list[AttentionKind]
    as_dict: bool
    dtype: torch.dtype

    @classmethod
    def of(cls, model: nn.Module, ids: Tensor, mask: Tensor) -> _Sequence:
        kinds, as_dict = attention_kinds(model.config)
        return cls(ids, *left_padded(mask), kinds, as_dict, mask_dtype(model))


def _noisy(
    model: nn.Module,
    decoder: nn.Module,
    cache: CleanCacheMixin,
    noise: SampleGumbel,
    seq: _Sequence,
    first: int,
    stop: int,
    sample: int,
    copies: int,
) -> Tensor:
    """One forward of samples ``sample … sample + copies − 1`` at positions ``first … stop − 1``: [B, Q, H]."""
    span = stop - first
    masks = teacher_forced_span_masks(
        seq.kinds, seq.as_dict, seq.valid, seq.left_pad, first, stop, copies, seq.dtype
    )
    query_ids = seq.ids[:, first:stop].repeat(1, copies)
    query_pos = seq.position[:, first:stop].repeat(1, copies)
    samples = (sample + torch.arange(copies, device=seq.ids.device)).repeat_interleave(span)[None, :]
    noise.layout = NoiseLayout(sample=samples, position=query_pos, scale=samples > 0)
    cache.plan = StepPlan(commit=0, exclude=seq.ids.shape[1] - max(stop - 1, 0))  # clean keys before stop − 1
    try:
        return final_hidden(
            model, decoder,
            input_ids=query_ids, attention_mask=masks, position_ids=query_pos, **with_cache(cache), use_cache=True,
        )  # fmt: skip
    finally:
        noise.layout = None
        cache.plan = None
