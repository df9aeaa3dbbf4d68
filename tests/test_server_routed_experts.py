"""Routed experts per request (#41 item 1), through the ``openai`` client as vLLM's and SGLang's
clients ask for them: ``return_routed_experts: true`` in the request (SGLang's field) or the server's
``--enable-return-routed-experts`` (vLLM's flag) puts ``routed_experts`` in each choice — a ``.npy``
in base64 of [prompt + completion − 1, MoE layers, top-k], one row per forwarded token — equal to
what ``moectl.route(record=True)`` records over the same tokens, streamed too, and a file that
``moectl offload simulate`` reads as it is."""

from __future__ import annotations

import base64
import json

import openai
import pytest
import torch
from fastapi.testclient import TestClient
from typer.testing import CliRunner

import moectl
from moectl.cli import app as cli
from moectl.engine import Engine, EngineConfig
from moectl.engine.engine import encode
from moectl.engine.routed_experts import decode
from moectl.server.app import create_app

MODEL = "tiny:olmoe"
ROE = {"tau": [0.5, 0.5, 0.5], "K": 2}


@pytest.fixture(scope="module")
def loaded():
    model, tok, info = moectl.load(MODEL, dtype="float32")
    return model, tok, info


def _client(loaded, **app_kw):
    model, tok, _ = loaded
    engine = Engine(model, tok, EngineConfig(max_batch=4), routings={"roe": json.dumps(ROE), "opt4": "option:4"})
    test = TestClient(create_app(engine, MODEL, **app_kw))
    return test, openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=test, max_retries=0)


def _offline(loaded, prompt_ids: list[int], completion: list[int]) -> torch.Tensor:
    model, _, _ = loaded
    with moectl.route(model, record=True) as session, torch.no_grad():
        model(torch.tensor([prompt_ids + completion[:-1]]))
    trace = session.trace
    return torch.stack([trace.chosen[layer][0] for layer in sorted(trace.chosen)], 1).int()


def test_a_request_that_asks_gets_its_tokens_experts(loaded):
    test, client = _client(loaded)
    with test:
        prompt = "The mixture of experts routes each token"
        asked = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
            extra_body={"return_routed_experts": True, "ignore_eos": True},
        )  # fmt: skip
        plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True})  # fmt: skip
    choice = asked.model_dump()["choices"][0]
    experts = decode(choice["routed_experts"])
    ids = encode(loaded[1], prompt)
    assert experts.shape == (len(ids) + 6 - 1, 3, 2)  # [forwarded tokens, MoE layers, top-k]
    assert experts.dtype == torch.int32 and int(experts.min()) >= 0 and int(experts.max()) < 8
    assert "routed_experts" not in plain.model_dump()["choices"][0]
    assert plain.choices[0].text == asked.choices[0].text
    want = _offline(loaded, ids, _engine_ids(loaded, prompt))
    assert torch.equal(experts, want)


def _engine_ids(loaded, prompt: str) -> list[int]:
    """The greedy tokens the engine generated (the text may not re-tokenize to them)."""
    from moectl.engine import SamplingParams

    model, tok, _ = loaded
    with Engine(model, tok) as engine:
        return engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids


def test_streamed_and_chat_choices_carry_the_same(loaded, tmp_path):
    test, client = _client(loaded)
    body = {"return_routed_experts": True, "ignore_eos": True}
    with test:
        whole = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=5, temperature=0,
                                          extra_body=body)  # fmt: skip
        chunks = list(client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=5, temperature=0,
                                                stream=True, extra_body=body))  # fmt: skip
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, temperature=0, extra_body=body)  # fmt: skip
    last = next(c.model_dump()["choices"][0] for c in chunks if c.choices and c.choices[0].finish_reason)
    assert last["routed_experts"] == whole.model_dump()["choices"][0]["routed_experts"]
    experts = decode(chat.model_dump()["choices"][0]["routed_experts"])
    assert experts.shape == (chat.usage.prompt_tokens + chat.usage.completion_tokens - 1, 3, 2)
    # the payload is a .npy file: written as it comes, `moectl offload simulate` replays it
    dump = tmp_path / "routed.npy"
    dump.write_bytes(base64.b64decode(last["routed_experts"]))
    out = tmp_path / "sim.json"
    result = CliRunner().invoke(cli, ["offload", "simulate", str(dump), "--num-experts", "8", "--budget", "4",
                                      "--policies", "lru,belady", "--json", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())


def test_the_server_flag_returns_them_for_every_request_a_roe_request_its_k_samples(loaded):
    test, client = _client(loaded, return_routed_experts=True)
    with test:
        got = client.completions.create(model=MODEL, prompt="Once", max_tokens=3, temperature=0,
                                        extra_body={"ignore_eos": True, "routing": "opt4"})  # fmt: skip
        assert decode(got.model_dump()["choices"][0]["routed_experts"]).shape[1:] == (3, 2)
        roe = client.completions.create(model=MODEL, prompt="Once", max_tokens=3, temperature=0,
                                        extra_body={"ignore_eos": True, "routing": "roe"})  # fmt: skip
    experts = decode(roe.model_dump()["choices"][0]["routed_experts"])
    prompt = len(encode(loaded[1], "Once"))
    assert experts.shape == (ROE["K"], prompt + 3 - 1, 3, 2)  # [K samples, tokens, MoE layers, top-k]
