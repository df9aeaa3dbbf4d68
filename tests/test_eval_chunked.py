"""Scoring without [K, T, V]: the chunked LM head equals the whole-distribution reference, in less memory.

``routed_token_scores`` runs the model to its final hidden states and the LM head on a few
positions at a time; ``routed_log_probs`` (the old path, kept as the reference) holds every
position's logits and a float32 copy. In float64 the two agree to rounding, for plain routing,
keyed Gumbel noise and K routed copies, whatever the chunk size; the largest tensor of a scoring
pass stays within the head budget, not T · V.
"""

from __future__ import annotations

import pytest
import torch

import moectl
from moectl import GumbelTopK
from moectl.eval.forward import BatchRouting, RequestBatch, request_keys, routed_log_probs, static_plan
from moectl.eval.request_noise import keyed_policies
from moectl.eval.token_scores import routed_token_scores
from moectl.metrics.memory import TensorMemory

pytestmark = pytest.mark.usefixtures("one_thread")


def _batch(vocab: int, lengths=(12, 7, 10), seed: int = 0) -> tuple[RequestBatch, torch.Tensor]:
    """A right-padded batch and its scored tokens (the last few of each row, never position 0)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), width), generator=g)
    pos = torch.arange(width)[None, :]
    length = torch.tensor(lengths)[:, None]
    mask = pos < length
    scored = mask & (pos >= length - torch.tensor([5, 6, 1])[:, None])
    ids = ids * mask
    return RequestBatch(ids, mask.long(), request_keys(ids, mask)), scored


def _reference(model, batch, plan, info, scored) -> tuple[torch.Tensor, torch.Tensor]:
    logp = routed_log_probs(model, batch, plan, info).double()
    target = batch.input_ids[:, 1:, None]
    lp = torch.nn.functional.pad(logp[:, :-1].gather(-1, target).squeeze(-1), (1, 0))
    greedy = torch.nn.functional.pad(logp[:, :-1].argmax(-1) == batch.input_ids[:, 1:], (1, 0), value=True)
    return lp * scored, greedy | ~scored


def _plans(info):
    return {
        "plain": static_plan(),
        "gumbel": static_plan([GumbelTopK(0.8, seed=2)]),
        "copies": lambda batch: BatchRouting(keyed_policies([GumbelTopK(0.8, seed=2)]), repeats=3),
    }


@pytest.mark.parametrize("family", ["olmoe", "granitemoe", "qwen2_moe", "gpt_oss"])
def test_chunked_scores_equal_the_whole_distribution_in_float64(family):
    model = moectl.tiny(family).double()
    info = moectl.inspect(model)
    batch, scored = _batch(int(model.config.vocab_size))
    for name, plan in _plans(info).items():
        lp_ref, greedy_ref = _reference(model, batch, plan, info, scored)
        for head_bytes in (1, 50_000, 1 << 27):  # one position per head call; a few; all at once
            scores = routed_token_scores(model, batch, plan, info, scored, head_bytes=head_bytes)
            assert scores.logprob.dtype == torch.float64
            torch.testing.assert_close(scores.logprob, lp_ref, atol=1e-10, rtol=0, msg=f"{name} {head_bytes}")
            assert torch.equal(scores.greedy, greedy_ref), (name, head_bytes)
        assert (lp_ref[scored] < 0).all()
    # the Gumbel noise is really active: its scores differ from the plain model's
    plain, _ = _reference(model, batch, static_plan(), info, scored)
    noisy, _ = _reference(model, batch, static_plan([GumbelTopK(0.8, seed=2)]), info, scored)
    assert (plain - noisy).abs().max() > 1e-6


@torch.no_grad()
def test_scoring_memory_does_not_grow_with_T_times_V():
    """A scoring pass's peak does not depend on V (the head runs on chunks within ``head_bytes``)
    and grows with T by far less than [T, V] logits; the reference path's peak grows with T · V,
    so the measurement sees a [T, V] tensor where there is one."""
    head_bytes = 1 << 20
    peak, largest, reference = {}, {}, {}
    for vocab in (4096, 32768):
        model = moectl.tiny("olmoe", vocab_size=vocab)
        model.set_experts_implementation("eager")
        info = moectl.inspect(model)
        plan = static_plan([GumbelTopK(0.5, seed=1)])
        for length in (64, 256):
            ids = torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(length))
            mask = torch.ones_like(ids)
            batch = RequestBatch(ids, mask, request_keys(ids, mask))
            with TensorMemory() as mem:
                routed_token_scores(model, batch, plan, info, mask.bool(), head_bytes=head_bytes)
            peak[vocab, length], largest[vocab, length] = mem.peak, mem.largest
            with TensorMemory() as ref:
                routed_log_probs(model, batch, plan, info)
            reference[vocab, length] = ref.peak
    grown_v = 256 * (32768 - 4096) * 4  # float32 logits of 256 positions, V from 4k to 32k
    assert reference[32768, 256] - reference[4096, 256] >= grown_v, reference
    assert peak[32768, 256] - peak[4096, 256] <= head_bytes, peak
    assert largest[32768, 256] <= head_bytes, largest
    grown_t = (256 - 64) * 32768 * 4
    assert peak[32768, 256] - peak[32768, 64] < grown_t / 8, peak
