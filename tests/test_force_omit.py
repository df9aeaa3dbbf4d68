"""Forcing and omitting experts (#41 item 5): ``{"type": "experts", "force": ..., "omit": ...}`` as a
policy, a registered routing and a request's own inline routing; bad ids refused naming layer and
expert; every router family's rule keeps forced experts in and omitted ones out."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient

import moectl
from moectl.adapters.rules import RouterRule
from moectl.engine import Engine, EngineConfig, SamplingParams
from moectl.engine.engine import encode
from moectl.errors import ConfigError
from moectl.routing import load_policy
from moectl.server.app import create_app

MODEL = "tiny:olmoe"
SPEC = {"type": "experts", "force": {"0": [3], "2": [5, 6]}, "omit": {"1": [0, 1]}}


@pytest.mark.parametrize("kind", ["softmax_topk", "topk_softmax", "sigmoid_topk", "sigmoid_dense"])
@pytest.mark.parametrize("norm", [False, True])
def test_every_rule_chooses_forced_first_and_keeps_its_weights(kind, norm):
    torch.manual_seed(0)
    rule = RouterRule(kind, top_k=3, num_experts=8, norm_topk_prob=norm)
    logits = torch.randn(16, 8)
    forced = torch.zeros(8, dtype=torch.bool)
    forced[[6, 7]] = True
    allowed = torch.ones(8, dtype=torch.bool)
    allowed[0] = False
    weights, idx = rule.select(logits, None, allowed, None, "pruned", forced)
    assert (idx == 6).any(-1).all() and (idx == 7).any(-1).all() and not (idx == 0).any()
    # the third slot is the rule's best other allowed expert; weights are the rule's for that set
    _plain_w, plain_idx = rule.select(logits, None, allowed & ~forced, None, "pruned")
    assert torch.equal(idx[:, 2], plain_idx[:, 0]) or kind == "sigmoid_dense"
    assert torch.isfinite(weights).all() and (weights > 0).all()


def test_the_policy_forces_and_omits_and_leaves_the_rest_to_the_router():
    model, tok, info = moectl.load(MODEL, dtype="float32")
    policy = load_policy(SPEC, info)
    ids = torch.tensor([encode(tok, "The mixture of experts routes each token")])
    with moectl.route(model, [policy], record=True) as routed, torch.no_grad():
        model(ids)
    with moectl.route(model, record=True) as plain, torch.no_grad():
        model(ids)
    chosen, free = routed.trace.chosen, plain.trace.chosen
    assert (chosen[0][0] == 3).any(-1).all()  # forced in layer 0 ...
    best_other = [next(e for e in row if e != 3) for row in plain.trace.probs[0][0].argsort(-1, descending=True).tolist()]
    assert [next(e for e in row if e != 3) for row in chosen[0][0].tolist()] == best_other  # ... the router's best beside it
    assert not ((chosen[1][0] == 0) | (chosen[1][0] == 1)).any()  # omitted in layer 1
    assert torch.equal(chosen[2][0].sort(-1).values, torch.tensor([[5, 6]] * ids.shape[1]))  # top-k = 2, both forced
    assert not torch.equal(free[0][0], chosen[0][0])
    assert load_policy(json.dumps(SPEC), info).to_dict() == policy.to_dict()  # inline JSON, round trip


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"force": {"0": [9]}}, "'force' of MoE layer 0: expert 9 is out of range; valid ids are 0..7"),
        ({"force": {"0": [1, 2, 3]}}, "'force' of MoE layer 0 lists 3 experts; the layer chooses top-k = 2"),
        ({"force": {"0": [1]}, "omit": {"0": [1]}}, "MoE layer 0: expert 1 is both forced and omitted"),
        ({"omit": {"0": [0, 1, 2, 3, 4, 5, 6]}}, "'omit' of MoE layer 0: allows only 1 experts"),
        ({"omit": {"5": [1]}}, "'omit': MoE layer 5 is out of range; the model has MoE layers 0..2"),
        ({"forse": {"0": [1]}}, "no field 'forse'"),
        ({}, "needs 'force' or 'omit'"),
    ],
)
def test_bad_lists_are_refused_naming_layer_and_expert(spec, words):
    _, _, info = moectl.load(MODEL)
    with pytest.raises(ConfigError, match=None) as refused:
        load_policy({"type": "experts", **spec}, info)
    assert words in str(refused.value)


def test_a_request_writes_its_routing_inline_and_it_equals_the_registered_one():
    model, tok, _ = moectl.load(MODEL, dtype="float32")
    engine = Engine(model, tok, EngineConfig(max_batch=4), routings={"fo": json.dumps(SPEC)})
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with TestClient(create_app(engine, MODEL)) as client:
        registered = client.post("/v1/completions", json={**body, "routing": "fo"}).json()
        inline = client.post("/v1/completions", json={**body, "routing": SPEC}).json()
        plain = client.post("/v1/completions", json=body).json()
        bad = client.post("/v1/completions", json={**body, "routing": {"type": "experts", "force": {"1": [8]}}})
        other = client.post("/v1/completions", json={**body, "routing": {"type": "controller", "path": "/etc"}})
        again = client.post("/v1/completions", json={**body, "routing": SPEC}).json()
        metrics = client.get("/metrics").text
    assert inline["choices"][0]["text"] == registered["choices"][0]["text"] != plain["choices"][0]["text"]
    assert inline["routing"].startswith("inline-") and again["routing"] == inline["routing"]
    assert bad.status_code == 400 and "'force' of MoE layer 1: expert 8 is out of range" in bad.json()["error"]["message"]
    assert bad.json()["error"]["param"] == "routing"
    assert other.status_code == 400 and "type among experts, topk, replay, expert_mask, gumbel, document_pool" in other.text
    assert 'routing="inline"' in metrics and "inline-" not in metrics  # one label for every inline routing


def test_engine_rows_with_forced_experts_batch_with_others():
    model, tok, _ = moectl.load(MODEL, dtype="float32")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = ["Once upon a time", "def f(x):", "2 + 2 ="]
    with Engine(model, tok, routings={"fo": json.dumps(SPEC)}) as engine:
        solo = [engine.generate([p], params, routing="fo")[0].token_ids for p in prompts]
        mixed = engine.generate(prompts, params, routing=["fo", None, "fo"])
    assert mixed[0].token_ids == solo[0] and mixed[2].token_ids == solo[2]
