"""Expert use per routing (#41 item 2): the engine's window of counts equals a recount from each
request's recorded trace; the window opens, closes and resets; ``moectl serve`` answers SGLang's
three endpoints and exports the counts in ``/metrics``."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient

import moectl
from moectl.engine import Engine, EngineConfig, SamplingParams
from moectl.server.app import create_app

MODEL = "tiny:olmoe"
HALF = {"type": "expert_mask", "experts": {str(layer): [0, 1, 2, 3] for layer in range(3)}}
PROMPTS = ["The mixture of experts routes each token", "def f(x):", "Once upon a time there was", "a"]


@pytest.fixture(scope="module")
def loaded():
    return moectl.load(MODEL, dtype="float32")


def _recount(done, num_experts: int) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for completion in done:
        trace = completion.trace
        counts = torch.stack(
            [torch.bincount(trace.chosen[layer][0].flatten(), minlength=num_experts) for layer in sorted(trace.chosen)]
        )
        name = completion.routing or "default"
        out[name] = out.get(name, 0) + counts
    return out


def test_the_window_equals_a_recount_from_the_traces(loaded):
    model, tok, info = loaded
    engine = Engine(model, tok, EngineConfig(max_batch=3, record=True), routings={"half": json.dumps(HALF), "opt4": "option:4"})
    params = SamplingParams(max_tokens=7, ignore_eos=True, temperature=1.0, seed=2)
    routings = [None, "half", "opt4", "half", None, "opt4", None, "half"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(routings))]
    with engine:
        assert engine.expert_counts.dump()["routings"] == {}
        engine.generate(prompts[:2], params)  # before the window: not counted
        engine.expert_counts.start()
        done = engine.generate(prompts, params, routing=routings)  # rows join and leave (max_batch 3)
        engine.expert_counts.stop()
        engine.generate(prompts[:2], params)  # after it: not counted
        dump = engine.expert_counts.dump()
    want = _recount(done, info.num_experts)
    assert sorted(dump["routings"]) == ["default", "half", "opt4"]
    for name, entry in dump["routings"].items():
        assert torch.equal(torch.tensor(entry["counts"]), want[name]), name
        tokens = sum(c.prompt_tokens + len(c.token_ids) - 1 for c in done if (c.routing or "default") == name)
        assert entry["tokens"] == tokens
    assert sum(dump["routings"]["half"]["counts"][0][4:]) == 0  # the mask's experts only
    assert dump["recording"] is False and dump["moe_layers"] == [0, 1, 2] and dump["num_experts"] == 8
    with engine:
        engine.expert_counts.start()  # a new window starts empty
        assert engine.expert_counts.dump()["routings"] == {}


def test_serve_answers_sglangs_endpoints_and_exports_metrics(loaded):
    model, tok, _ = loaded
    engine = Engine(model, tok, EngineConfig(max_batch=4), routings={"half": json.dumps(HALF)})
    with TestClient(create_app(engine, MODEL)) as client:
        assert client.post("/start_expert_distribution_record").json() == {"recording": True}
        for routing in (None, "half"):
            body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 4, "ignore_eos": True, "routing": routing}
            assert client.post("/v1/completions", json=body).status_code == 200
        dump = client.post("/dump_expert_distribution_record").json()
        assert dump["recording"] is True and set(dump["routings"]) == {"default", "half"}
        assert client.get("/stop_expert_distribution_record").json() == {"recording": False}
        metrics = client.get("/metrics").text
        missing = client.get("/start_expert_distribution").json()["error"]["message"]  # a 404 lists every route
    for route in ("POST /start_expert_distribution_record", "POST /tokenize", "GET /tokenizer_info", "GET /metrics"):
        assert route in missing, missing
    prompt = tok("Once upon")["input_ids"].shape[-1]  # a batch of one
    for name in ("default", "half"):
        entry = dump["routings"][name]
        assert entry["tokens"] == prompt + 4 - 1
        assert all(sum(row) == entry["tokens"] * 2 for row in entry["counts"])  # top-2 per token and layer
    assert 'moectl_expert_tokens{expert="0",layer="0",routing="half"}' in metrics
