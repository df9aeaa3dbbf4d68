"""The engine's log-probabilities (``SamplingParams.logprobs`` / ``prompt_logprobs``) against one
offline forward of the same ids: batched with prompts of other lengths, past the chunking length,
beside a stored prompt prefix, and under RoE (generated tokens: the ensemble's distribution)."""

from __future__ import annotations

import pytest
import torch

import moectl
from moectl.engine import Engine, EngineConfig, SamplingParams
from moectl.errors import ConfigError

TOL = 1e-4


@pytest.fixture(scope="module")
def loaded():
    model, tok, _ = moectl.load("tiny:olmoe", dtype="float32")
    return model, tok


def reference(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)


def check(model, prompt: list[int], done, top: int) -> None:
    ref = reference(model, prompt + done.token_ids)
    assert len(done.prompt_logprobs) == len(prompt) - 1
    for j, entry in enumerate(done.prompt_logprobs):  # position j predicts prompt token j + 1
        assert entry.token == prompt[j + 1]
        assert entry.logprob == pytest.approx(ref[j, prompt[j + 1]].item(), abs=TOL)
        assert [t for t, _ in entry.top] == ref[j].topk(top).indices.tolist()
    n = len(prompt)
    for j, entry in enumerate(done.logprobs):
        assert entry.token == done.token_ids[j]
        assert entry.logprob == pytest.approx(ref[n - 1 + j, entry.token].item(), abs=TOL)


def test_prompt_and_generated_logprobs_of_a_batch_equal_one_forward_each(loaded):
    model, tok = loaded
    prompts = [tok.encode(p) for p in ("Hello world, this is a prompt", "abc", "a somewhat longer prompt here")]
    params = SamplingParams(max_tokens=5, logprobs=2, prompt_logprobs=3, ignore_eos=True)
    done = Engine(model, tok, EngineConfig(max_batch=4)).generate(prompts, [params] * 3)
    for prompt, one in zip(prompts, done, strict=True):
        check(model, prompt, one, 3)
        assert all(len(e.top) == 2 for e in one.logprobs)


def test_a_long_prompt_with_prompt_logprobs_is_prefilled_whole(loaded):
    model, tok = loaded
    prompt = tok.encode("x y z " * 20)
    config = EngineConfig(prefill_chunk=8, prefix_cache_tokens=512)
    engine = Engine(model, tok, config)
    params = SamplingParams(max_tokens=2, logprobs=0, prompt_logprobs=1, ignore_eos=True)
    first, second = engine.generate([prompt, prompt], [params, params])  # the second could reuse a prefix
    check(model, prompt, first, 1)
    check(model, prompt, second, 1)


def test_requests_without_logprobs_get_none(loaded):
    model, tok = loaded
    done = Engine(model, tok).generate(["abc"], SamplingParams(max_tokens=3))[0]
    assert done.logprobs is None and done.prompt_logprobs is None


def test_roe_generated_logprobs_are_the_ensembles_and_echo_is_refused(loaded):
    model, tok = loaded
    roe = {"tau": [0.5, 0.5, 0.5], "K": 3}
    engine = Engine(model, tok, routings={"roe": roe})
    done = engine.generate(["abc"], SamplingParams(max_tokens=4, logprobs=1, ignore_eos=True), "roe")[0]
    assert len(done.logprobs) == 4
    assert all(e.logprob <= 0 and e.top[0][1] >= e.logprob - 1e-6 for e in done.logprobs)  # greedy: the top one
    with pytest.raises(ConfigError, match="not RoE"):
        engine.submit("abc", SamplingParams(max_tokens=2, prompt_logprobs=1), routing="roe")


@pytest.mark.parametrize("bad", [-1, 21, 2.5, True])
def test_logprob_counts_are_checked(bad):
    with pytest.raises(ConfigError, match="from 0 to 20"):
        SamplingParams(logprobs=bad)
