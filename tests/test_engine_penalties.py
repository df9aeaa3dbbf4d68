"""The engine's penalties, bias and filters (``engine.penalties``, ``engine.sampling``): equal to
OpenAI's formulas and transformers' processors, per row whatever the batch, checked at the boundary."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import moectl
from moectl.engine import Engine, EngineConfig, SamplingParams
from moectl.engine.penalties import apply_penalties, prompt_mask
from moectl.engine.sampling import filter_mask
from moectl.errors import ConfigError

V = 50


def reference(logits: torch.Tensor, params: SamplingParams, generated: list[int], prompt: list[int]) -> torch.Tensor:
    """One row, token by token: OpenAI's bias and penalties, transformers' repetition penalty."""
    out = logits.clone()
    for token, bias in params.logit_bias:
        out[token] += bias
    seen = set(generated) | set(prompt)
    rep = RepetitionPenaltyLogitsProcessor(params.repetition_penalty) if params.repetition_penalty != 1 else None
    if rep is not None and seen:
        out = rep(torch.tensor([sorted(seen)]), out[None])[0]
    for token in set(generated):
        c = generated.count(token)
        out[token] -= c * params.frequency_penalty + params.presence_penalty
    return out


def test_penalties_equal_the_formulas_row_by_row():
    torch.manual_seed(0)
    rows = [
        (SamplingParams(presence_penalty=0.5, frequency_penalty=1.5), [3, 3, 7], [1, 2]),
        (SamplingParams(repetition_penalty=1.3), [4, 9, 9], [1, 4, 11]),
        (SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.5, logit_bias={5: 3.0, 9: -100}), [], [6]),
        (SamplingParams(logit_bias={0: 1.0}), [0] * 5, [2]),
    ]
    logits = torch.randn(len(rows), V) * 3
    masks = [prompt_mask(p, V, logits.device) if s.repetition_penalty != 1 else None for s, _, p in rows]
    got = apply_penalties(logits, [s for s, _, _ in rows], [g for _, g, _ in rows], masks)
    for i, (params, generated, prompt) in enumerate(rows):
        want = reference(logits[i], params, generated, prompt if params.repetition_penalty != 1 else [])
        torch.testing.assert_close(got[i], want)


def test_filters_equal_transformers_warpers():
    """top-k, then top-p on what it kept, then min-p: the tokens dropped are those transformers'
    TopK → TopP → MinP warpers set to -inf, each row with its own values."""
    torch.manual_seed(1)
    logits = torch.randn(6, 200) * 2
    top_k = torch.tensor([0, 5, 50, 1, 0, 20])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.9, 1.0, 0.8])
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.3, 0.05])
    drop = filter_mask(logits, top_p, top_k, min_p)
    for i in range(6):
        row = logits[i : i + 1].clone()
        if top_k[i] > 0:
            row = TopKLogitsWarper(int(top_k[i]))(None, row)
        if top_p[i] < 1:
            row = TopPLogitsWarper(float(top_p[i]))(None, row)
        if min_p[i] > 0:
            row = MinPLogitsWarper(float(min_p[i]))(None, row)
        assert drop[i].tolist() == torch.isinf(row[0]).tolist(), i
    assert filter_mask(logits, top_p).tolist() == filter_mask(logits, top_p, torch.zeros(6, dtype=torch.long)).tolist()


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer, _ = moectl.load("tiny:olmoe", dtype="float32")
    return model, tokenizer


def test_repetition_penalty_greedy_equals_transformers_generate(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, EngineConfig(max_batch=4))
    prompts = ["Once upon a time", "2 + 2 =", "Hello there"]
    for penalty in (1.3, 0.7):
        params = SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=penalty)
        for prompt, got in zip(prompts, engine.generate(prompts, params), strict=True):
            ids = torch.tensor([tokenizer.encode(prompt)])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                repetition_penalty=penalty, pad_token_id=0,
            )  # fmt: skip
            assert got.token_ids == out[0, ids.shape[1] :].tolist(), (penalty, prompt)


def test_each_request_is_penalised_as_it_would_be_alone(tiny):
    """A batch mixing penalised, biased, filtered and plain requests: each equals itself run alone."""
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, EngineConfig(max_batch=8))
    asks = [
        ("Once upon a time", SamplingParams(max_tokens=10, ignore_eos=True, frequency_penalty=1.0)),
        ("Once upon a time", SamplingParams(max_tokens=10, ignore_eos=True)),
        ("2 + 2 =", SamplingParams(max_tokens=10, ignore_eos=True, presence_penalty=2.0, logit_bias={7: 5.0})),
        ("Hello", SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, seed=3, top_k=5, min_p=0.05)),
        ("Hello", SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, seed=4, repetition_penalty=1.2)),
    ]
    together = [c.token_ids for c in engine.generate([p for p, _ in asks], [s for _, s in asks])]
    alone = [engine.generate([p], s)[0].token_ids for p, s in asks]
    assert together == alone
    assert together[0] != together[1]  # the penalty changed the text


def test_logit_bias_forces_and_bans_tokens(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, EngineConfig(max_batch=2))
    forced = engine.generate(["Hello"], SamplingParams(max_tokens=6, ignore_eos=True, logit_bias={7: 100.0}))
    assert forced[0].token_ids == [7] * 6
    plain = engine.generate(["Hello"], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    banned = engine.generate(
        ["Hello"], SamplingParams(max_tokens=6, ignore_eos=True, logit_bias=dict.fromkeys(set(plain), -100.0))
    )[0].token_ids
    assert not set(banned) & set(plain)


def test_top_k_of_one_samples_the_greedy_token(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, EngineConfig(max_batch=2))
    greedy = engine.generate(["Hello"], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    sampled = engine.generate(["Hello"], SamplingParams(max_tokens=8, ignore_eos=True, temperature=2.0, top_k=1))
    assert sampled[0].token_ids == greedy


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"presence_penalty": 3.0}, "presence_penalty must be a number in [-2, 2]"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty must be a number in [-2, 2]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be a number > 0"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"min_p": 2.0}, "min_p must be in [0, 1]"),
        ({"logit_bias": {"7": 1.0}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {7: 200.0}}, "logit_bias values must be numbers in [-100, 100]"),
        ({"logit_bias": dict.fromkeys(range(301), 1.0)}, "at most 300"),
    ],
)
def test_bad_sampling_values_are_refused(kwargs, words):
    with pytest.raises(ConfigError) as err:
        SamplingParams(**kwargs)
    assert words in str(err.value)


def test_a_biased_token_outside_the_vocabulary_is_refused(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, EngineConfig(max_batch=1))
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        engine.submit("Hello", SamplingParams(logit_bias={10**6: 1.0}))


def test_stop_token_ids_end_a_request_as_eos_does(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, EngineConfig(max_batch=2))
    plain = engine.generate(["Hello"], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    third = plain.token_ids[2]
    first = plain.token_ids.index(third)  # the first time it comes
    got = engine.generate(["Hello"], SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=(third,)))[0]
    assert got.finish_reason == "stop" and got.token_ids == plain.token_ids[:first] and got.stop_token == third


def test_min_tokens_holds_back_eos_stop_tokens_and_stop_strings(tiny):
    """EOS pushed up by a bias: without min_tokens the request ends at once; with min_tokens = 5 it
    cannot choose EOS before its 5th token and ends right after. A stop string in its first tokens'
    text does not count."""
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, EngineConfig(max_batch=2))
    eos = tokenizer.eos_token_id
    pushed = SamplingParams(max_tokens=12, logit_bias={eos: 100.0})
    assert engine.generate(["Hello"], pushed)[0].token_ids == []
    held = engine.generate(["Hello"], SamplingParams(max_tokens=12, logit_bias={eos: 100.0}, min_tokens=5))[0]
    assert len(held.token_ids) == 5 and held.finish_reason == "stop" and held.stop_token == eos
    plain = engine.generate(["Hello"], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    stop = plain.text[:2]
    assert stop and engine.generate(["Hello"], SamplingParams(max_tokens=8, ignore_eos=True, stop=stop))[0].text == ""
    late = engine.generate(["Hello"], SamplingParams(max_tokens=8, ignore_eos=True, stop=stop, min_tokens=8))[0]
    assert late.text == plain.text  # its only occurrence lies in the first tokens' text


def test_the_generation_configs_eos_ids_stop_too(tiny):
    """Qwen3 and gpt-oss list several EOS ids in generation_config: the engine stops at each, as
    ``model.generate`` does."""
    model, tokenizer = tiny
    plain = Engine(model, tokenizer, EngineConfig(max_batch=2)).generate(
        ["Hello"], SamplingParams(max_tokens=8, ignore_eos=True)
    )[0]
    before = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, plain.token_ids[3]]
    try:
        got = Engine(model, tokenizer, EngineConfig(max_batch=2)).generate(["Hello"], SamplingParams(max_tokens=8))[0]
    finally:
        model.generation_config.eos_token_id = before
    first = plain.token_ids.index(plain.token_ids[3])
    assert got.token_ids == plain.token_ids[:first] and got.finish_reason == "stop"


def test_bad_stop_token_ids_and_min_tokens_are_refused(tiny):
    with pytest.raises(ConfigError, match="min_tokens must be an integer from 0 to max_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ConfigError, match="stop_token_ids must be token ids"):
        SamplingParams(stop_token_ids=(-1,))
    model, tokenizer = tiny
    with pytest.raises(ConfigError, match="stop_token_ids token id 1000000 is outside the vocabulary"):
        Engine(model, tokenizer, EngineConfig(max_batch=1)).submit("Hi", SamplingParams(stop_token_ids=(10**6,)))


def test_reported_log_probabilities_are_the_models_before_the_bias(tiny):
    """A token forced by a +100 bias reports the model's own log-probability of it: the one the
    prompt's scoring (echo) gives the same ids, not the ≈ 0 of the biased distribution."""
    from moectl.engine.engine import encode

    model, tokenizer = tiny
    engine = Engine(model, tokenizer, EngineConfig(max_batch=2))
    forced = engine.generate(
        ["Hello"], SamplingParams(max_tokens=3, ignore_eos=True, logit_bias={7: 100.0}, logprobs=0)
    )[0]
    assert forced.token_ids == [7, 7, 7]
    ids = [*encode(tokenizer, "Hello"), 7, 7, 7]
    scored = engine.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs
    want = [entry.logprob for entry in scored[-3:]]
    got = [entry.logprob for entry in forced.logprobs]
    assert got == pytest.approx(want, abs=1e-4) and max(got) < -0.5
