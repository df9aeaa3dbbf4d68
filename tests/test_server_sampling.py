"""``moectl serve``'s sampling fields against the ``openai`` client: ``n`` choices (whole and
streamed, several prompts streamed together), OpenAI's penalties and ``logit_bias``, vLLM's
``top_k`` / ``min_p`` / ``repetition_penalty``; each equal to what the engine or transformers
computes offline for the same request."""

from __future__ import annotations

from collections import defaultdict

import httpx
import pytest
import torch

import moectl
from _server_helpers import Server

MODEL = "tiny:olmoe"


@pytest.fixture(scope="module")
def server():
    running = Server("--dtype", "float32", "--max-batch", "8")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def offline():
    model, tokenizer, _ = moectl.load(MODEL, dtype="float32")
    return model, tokenizer


def test_n_choices_are_prompt_major_each_with_its_seed(client):
    """Choice i · n + j of a request equals prompt i asked alone with seed + j."""
    common = {"model": MODEL, "max_tokens": 8, "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    out = client.completions.create(prompt=["Once upon", "2 + 2"], n=3, seed=5, **common)
    assert [c.index for c in out.choices] == list(range(6))
    for i, prompt in enumerate(["Once upon", "2 + 2"]):
        for j in range(3):
            alone = client.completions.create(prompt=prompt, seed=5 + j, **common).choices[0].text
            assert out.choices[3 * i + j].text == alone
    assert len({c.text for c in out.choices[:3]}) > 1  # three seeds, three draws
    assert out.usage.completion_tokens == 6 * 8


def _by_index(chunks, chat: bool) -> dict[int, str]:
    texts: dict[int, str] = defaultdict(str)
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += (choice.delta.content or "") if chat else choice.text
    return dict(texts)


@pytest.mark.parametrize("chat", [False, True])
def test_n_streamed_choices_concatenate_to_the_whole_ones(client, chat):
    common = {"model": MODEL, "max_tokens": 10, "temperature": 0.9, "seed": 11, "n": 3}
    if chat:
        create, kwargs = client.chat.completions.create, {"messages": [{"role": "user", "content": "Tell me"}]}
    else:
        create, kwargs = client.completions.create, {"prompt": "Tell me"}
    whole = create(**common, **kwargs)
    chunks = list(create(stream=True, stream_options={"include_usage": True}, **common, **kwargs))
    usage = chunks.pop()
    assert usage.choices == [] and usage.usage.completion_tokens == whole.usage.completion_tokens
    texts = _by_index(chunks, chat)
    want = {c.index: (c.message.content if chat else c.text) for c in whole.choices}
    assert texts == want
    finishes = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    if chat:
        opened = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
        assert sorted(opened) == [0, 1, 2]


def test_several_prompts_stream_together(client):
    prompts = ["Once upon a time", "Hello", "2 + 2 ="]
    whole = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0, stream=True))
    assert _by_index(chunks, chat=False) == {c.index: c.text for c in whole.choices}


def test_repetition_penalty_equals_transformers_generate(client, offline):
    model, tokenizer = offline
    got = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0,
        extra_body={"repetition_penalty": 1.4, "ignore_eos": True},
    )  # fmt: skip
    ids = torch.tensor([tokenizer.encode("Once upon a time")])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12, do_sample=False,
        repetition_penalty=1.4, pad_token_id=0,
    )  # fmt: skip
    assert got.choices[0].text == tokenizer.decode(out[0, ids.shape[1] :].tolist())


def test_penalties_and_bias_equal_the_engine_offline(client, offline):
    from moectl.engine import Engine, EngineConfig, SamplingParams

    model, tokenizer = offline
    fields = {"frequency_penalty": 1.2, "presence_penalty": 0.4, "top_k": 8, "min_p": 0.02}
    got = client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=10, temperature=0.7, seed=9, logit_bias={"5": 2.0},
        frequency_penalty=1.2, presence_penalty=0.4, extra_body={"top_k": 8, "min_p": 0.02, "ignore_eos": True},
    )  # fmt: skip
    params = SamplingParams(max_tokens=10, temperature=0.7, seed=9, logit_bias={5: 2.0}, ignore_eos=True, **fields)
    want = Engine(model, tokenizer, EngineConfig(max_batch=1)).generate(["Hello there"], params)[0].text
    assert got.choices[0].text == want


def test_logit_bias_forces_a_token_and_vllm_top_k_minus_one_means_all(client, offline):
    _, tokenizer = offline
    forced = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logit_bias={"7": 100}, extra_body={"ignore_eos": True}
    )
    assert forced.choices[0].text == tokenizer.decode([7] * 4)
    plain = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0.8, seed=1)
    all_k = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=4, temperature=0.8, seed=1, extra_body={"top_k": -1}
    )
    assert all_k.choices[0].text == plain.choices[0].text


def test_a_refused_request_of_n_choices_leaves_nothing_running(server):
    """n = 2 with a biased id outside the vocabulary: a 400 naming it, no row left running or waiting."""
    body = {"model": MODEL, "prompt": "x", "n": 2, "logit_bias": {"999999": 1}}
    response = httpx.post(f"{server.base}/v1/completions", json=body)
    assert response.status_code == 400 and "outside the vocabulary" in response.json()["error"]["message"]
    health = httpx.get(f"{server.base}/health").json()
    assert health["running"] == 0 and health["waiting"] == 0


def test_vllm_stop_token_ids_and_min_tokens(client, offline):
    from moectl.engine import Engine, EngineConfig, SamplingParams

    model, tokenizer = offline
    plain = Engine(model, tokenizer, EngineConfig(max_batch=1)).generate(
        ["Hello"], SamplingParams(max_tokens=8, ignore_eos=True)
    )[0]  # the server's greedy ids (test_server_openai: greedy equals offline)
    ids = plain.token_ids
    stop_id = ids[2]
    got = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]},
    )  # fmt: skip
    assert got.choices[0].finish_reason == "stop" and got.usage.completion_tokens == ids.index(stop_id)
    eos = tokenizer.eos_token_id
    held = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=8, temperature=0, logit_bias={str(eos): 100},
        extra_body={"min_tokens": 3},
    )  # fmt: skip
    assert held.usage.completion_tokens == 3 and held.choices[0].finish_reason == "stop"


def test_vllm_extras_moectl_does_not_do_are_refused(server):
    for body, param in [
        ({"use_beam_search": True}, "use_beam_search"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"min_tokens": 5, "max_tokens": 4}, None),
    ]:
        response = httpx.post(f"{server.base}/v1/completions", json={"model": MODEL, "prompt": "x", **body})
        assert response.status_code == 400, body
        assert response.json()["error"]["param"] == param


def test_the_prefill_benchmark_times_new_prompts_of_each_length(server, tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import prefill_ttft

    out = prefill_ttft.main(
        ["--url", server.base, "--model", MODEL, "--tokens", "20,40", "--repeat", "1", "--low", "3", "--high", "250",
         "--json", str(tmp_path / "p.json")]
    )  # fmt: skip
    assert [r["tokens"] for r in out["results"]] == [20, 40]
    assert all(len(r["seconds"]) == 1 and r["seconds"][0] > 0 for r in out["results"])
