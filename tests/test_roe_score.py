"""RoE log-likelihood of continuations (perplexity, multiple choice) and adaptive K."""

from __future__ import annotations

import functools
import math

import pytest
import torch

import moectl
from moectl.models.load import ByteTokenizer, load_model
from moectl.roe import AdaptiveEnsemble, RoEConfig, score, token_logprobs, trade_off
from moectl.roe.score import pad_left, scored_request, token_logprobs_stepwise
from moectl.roe.score_data import ChoiceItem, LMItem

TEXTS = ["The quick brown fox jumps.", "Hello there", "Experts route."]


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def _load(family: str):
    if family == "gpt_oss":  # a sliding window of 8 so that short texts cross it
        return moectl.tiny("gpt_oss", vocab_size=ByteTokenizer.vocab_size, sliding_window=8), ByteTokenizer()
    return load_model(f"tiny:{family}")


def _batch():
    tokenizer = ByteTokenizer()
    seqs = [scored_request(tokenizer, "", t, 512) for t in TEXTS] + [
        scored_request(tokenizer, "Q: hi", " A: yes", 512)
    ]
    return pad_left(seqs, 0, torch.device("cpu"))


@pytest.mark.parametrize(
    ("family", "aggregation"),
    [
        ("olmoe", "prob_mean"),
        ("olmoe", "logprob_mean"),
        ("gpt_oss", "prob_mean"),
        ("deepseek_v3", "logprob_mean"),
    ],
)
def test_parallel_scoring_equals_stepwise_and_recompute(family, aggregation):
    """Two-forward parallel scoring = teacher-forced clean-cache steps = no-cache recompute (tau > 0)."""
    model, _ = _load(family)
    ids, mask, scored = _batch()
    config = RoEConfig(K=4, tau=0.5, seed=2, aggregation=aggregation)
    parallel = token_logprobs(model, ids, mask, scored, config, method="parallel")
    stepwise = token_logprobs(model, ids, mask, scored, config, method="stepwise")
    recompute = token_logprobs(model, ids, mask, scored, config.with_(cache="none"))
    torch.testing.assert_close(parallel, stepwise, atol=2e-5, rtol=0)
    torch.testing.assert_close(parallel, recompute, atol=2e-5, rtol=0)
    assert (parallel[scored] < 0).all() and (parallel[~scored] == 0).all()


def test_hybrid_scores_stepwise():
    model, _ = _load("qwen3_next")
    ids, mask, scored = _batch()
    config = RoEConfig(K=3, tau=0.5)
    auto = token_logprobs(model, ids, mask, scored, config)
    recompute = token_logprobs(model, ids, mask, scored, config.with_(cache="none"))
    torch.testing.assert_close(auto, recompute, atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="attention-only"):
        token_logprobs(model, ids, mask, scored, config, method="parallel")


def test_tau_zero_perplexity_is_the_plain_models():
    model, tokenizer = _load("olmoe")
    items = [LMItem("", t) for t in TEXTS]
    result = score(model, tokenizer, items, RoEConfig(K=4, tau=0.0))
    nll, n = 0.0, 0
    with torch.no_grad():
        for text in TEXTS:
            ids = torch.tensor([[tokenizer.bos_token_id, *tokenizer.encode(text)]])
            logp = model(ids).logits[0, :-1].log_softmax(-1)
            nll -= float(logp.gather(-1, ids[0, 1:, None]).sum())
            n += ids.shape[1] - 1
    assert result.tokens == n
    assert result.ppl == pytest.approx(math.exp(nll / n), rel=1e-5)


def test_multiple_choice_picks_the_highest_loglik_choice():
    model, tokenizer = _load("olmoe")
    config = RoEConfig(K=4, tau=0.3)
    context = "The answer is"
    ids = torch.tensor([[tokenizer.bos_token_id, *tokenizer.encode(context)]])
    # single-byte choices: the best choice is the argmax of the RoE next-token distribution
    from moectl.roe import Ensemble

    printable = 3 + 32  # token of " "; ASCII printable bytes are single tokens that decode and re-encode
    with Ensemble(model, config) as ens:
        best = int(ens.start(ids).logprobs[0, printable : printable + 95].argmax())
    choices = [tokenizer.decode([printable + (best + shift) % 95]) for shift in (0, 7, 50)]
    items = [
        ChoiceItem(context, choices, 0),
        ChoiceItem(context, choices[::-1], 2),
        ChoiceItem(context, choices, 1),
    ]
    result = score(model, tokenizer, items, config)
    assert result.predictions == [0, 2, 0]
    assert result.accuracy == pytest.approx(2 / 3)


def test_adaptive_k_interpolates_between_k1_and_fixed_k():
    model, _ = _load("olmoe")
    ids, mask, scored = _batch()
    config = RoEConfig(K=4, tau=0.5, seed=1)
    fixed = token_logprobs(model, ids, mask, scored, config, method="stepwise")
    single = token_logprobs(model, ids, mask, scored, config.with_(K=1))
    always = AdaptiveEnsemble(model, config, threshold=0.0)
    never = AdaptiveEnsemble(model, config, threshold=1e9)
    torch.testing.assert_close(
        token_logprobs_stepwise(model, ids, mask, scored, config, ensemble=always) * scored,
        fixed,
        atol=2e-5,
        rtol=0,
    )
    torch.testing.assert_close(
        token_logprobs_stepwise(model, ids, mask, scored, config, ensemble=never) * scored,
        single,
        atol=2e-5,
        rtol=0,
    )
    assert always.samples_per_token == 4 and never.samples_per_token == 1


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_next"])
def test_adaptive_second_pass_sees_the_right_prefix(family):
    """Sliding windows (an evicted key) and recurrent states (pre-commit state) in the second pass."""
    model, _ = _load(family)
    ids, mask, scored = _batch()
    config = RoEConfig(K=3, tau=0.5)
    fixed = token_logprobs(model, ids, mask, scored, config, method="stepwise")
    always = AdaptiveEnsemble(model, config, threshold=0.0)
    got = token_logprobs_stepwise(model, ids, mask, scored, config, ensemble=always) * scored
    torch.testing.assert_close(got, fixed, atol=2e-5, rtol=0)


def test_trade_off_reports_compute_and_quality():
    model, tokenizer = _load("olmoe")
    rows = trade_off(
        model, tokenizer, [LMItem("", t) for t in TEXTS], RoEConfig(K=4, tau=0.4), quantiles=(0.5,)
    )
    assert [r["mode"].split(" ")[0] for r in rows] == ["fixed", "fixed", "adaptive"]
    assert rows[0]["samples_per_token"] == 1 and rows[1]["samples_per_token"] == 4
    assert 1 < rows[2]["samples_per_token"] < 4
    assert rows[2]["noisy_fraction"] == pytest.approx(
        0.5, abs=0.1
    )  # the median entropy splits tokens in half
    assert all(r["ppl"] > 1 for r in rows)
