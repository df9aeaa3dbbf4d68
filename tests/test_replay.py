"""Routing replay (#41 item 4): ``Replay`` routes each token to the experts a record gives it, weighted
by the router's own probabilities over them (the family's rule), in ``moectl.route`` (the RL
trainer's forward) and in the engine (a served request), from a ``RoutingTrace``, a routed-experts
response (base64 .npy) or vLLM's/SGLang's nested lists. Round trips are bit-exact in float32."""

from __future__ import annotations

import json

import pytest
import torch

import moectl
from moectl import GumbelTopK, Replay, route
from moectl.engine import Engine, EngineConfig, SamplingParams
from moectl.engine.routings import Routing
from moectl.errors import ConfigError
from moectl.io.npy_text import encode
from moectl.routing.policy_files import load_policy
from moectl.routing.top_k import with_top_k

FAMILIES = ["olmoe", "qwen3_moe", "deepseek_v3", "gpt_oss"]  # softmax, renormalised, sigmoid + groups, top-k→softmax


@pytest.mark.parametrize("family", FAMILIES)
def test_the_rules_weights_of_its_own_choice_are_its_weights(family):
    _, _, info = moectl.load(f"tiny:{family}", dtype="float32")
    rule = info.layers[0].rule
    logits = torch.randn(64, rule.num_experts) * 2
    weights, idx = rule.select(logits)
    assert torch.equal(rule.weights_of(logits, idx), weights)
    # a narrower record (k' slots live, the rest weight 0) weighs as the rule at k' does
    narrow_w, narrow_idx = with_top_k(rule, 1).select(logits)
    padded = torch.cat([narrow_idx, narrow_idx.expand(-1, rule.top_k - 1)], -1)
    live = torch.zeros_like(padded, dtype=torch.bool)
    live[:, 0] = True
    got = rule.weights_of(logits, padded, live)
    torch.testing.assert_close(got[:, :1], narrow_w, rtol=1e-6, atol=0)
    assert torch.equal(got[:, 1:], torch.zeros_like(got[:, 1:]))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_noisy_rollout_replays_bit_exact_in_float32(family):
    model, _, info = moectl.load(f"tiny:{family}", dtype="float32")
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with route(model, [GumbelTopK(1.0, seed=3)], record=True) as rollout, torch.no_grad():
        noisy = model(input_ids=ids).logits
    with route(model, record=True) as plain, torch.no_grad():
        clean = model(input_ids=ids).logits
    assert not torch.equal(noisy, clean)  # the noise changed the routing
    with route(model, [Replay.from_trace(rollout.trace)], record=True) as replayed, torch.no_grad():
        again = model(input_ids=ids).logits
    assert torch.equal(again, noisy)
    for layer in range(info.num_moe_layers):
        assert torch.equal(replayed.trace.chosen[layer], rollout.trace.chosen[layer])
    assert not all(torch.equal(plain.trace.chosen[i], rollout.trace.chosen[i]) for i in range(info.num_moe_layers))


def test_a_training_forward_routes_as_the_record_and_the_router_learns():
    model, _, info = moectl.load("tiny:qwen3_moe", dtype="float32")
    ids = torch.randint(0, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: the record counts each row's real tokens
    with route(model, [GumbelTopK(2.0, seed=5)], record=True) as rollout, torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    record = Replay.from_trace(rollout.trace)
    assert record.experts.shape == (2, 10, info.num_moe_layers, info.layers[0].top_k)
    assert bool((record.experts[1, 7:] == -1).all()) and bool((record.experts[1, :7] >= 0).all())
    model.train()
    with route(model, [record], record=True) as session:
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        out.loss.backward()
    model.eval()
    valid = mask.bool()
    for layer in range(info.num_moe_layers):
        assert torch.equal(session.trace.chosen[layer][valid], rollout.trace.chosen[layer][valid])
    router = info.layers[0].router
    grad = router.weight.grad
    assert grad is not None and bool(torch.isfinite(grad).all()) and float(grad.abs().sum()) > 0


def test_past_the_record_the_router_chooses_and_start_offsets_it():
    model, _, info = moectl.load("tiny:olmoe", dtype="float32")
    ids = torch.randint(0, model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(3))
    with route(model, [GumbelTopK(1.0, seed=1)], record=True) as rollout, torch.no_grad():
        model(input_ids=ids)
    with route(model, record=True) as plain, torch.no_grad():
        model(input_ids=ids)
    full = Replay.from_trace(rollout.trace).experts[0]  # [T, L, k]
    with route(model, [Replay(full[4:7], start=4)], record=True) as part, torch.no_grad():
        model(input_ids=ids)
    for layer in range(info.num_moe_layers):
        got = part.trace.chosen[layer][0]
        assert torch.equal(got[4:7], rollout.trace.chosen[layer][0, 4:7])
        assert torch.equal(got[:4], plain.trace.chosen[layer][0, :4])  # before start: the router's
    # continuing calls count from the KV cache's length
    with route(model, [Replay(full)], record=True) as cont, torch.no_grad():
        first = model(input_ids=ids[:, :6], use_cache=True)
        model(input_ids=ids[:, 6:], past_key_values=first.past_key_values, use_cache=True)
    for layer in range(info.num_moe_layers):
        assert torch.equal(cont.trace.chosen[layer], rollout.trace.chosen[layer])


def test_a_narrower_record_replays_as_topk_n():
    model, _, _ = moectl.load("tiny:qwen3_moe", dtype="float32")
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(4))
    with route(model, ["topk:1"], record=True) as made, torch.no_grad():
        want = model(input_ids=ids).logits
    with route(model, [Replay.from_trace(made.trace)]), torch.no_grad():
        got = model(input_ids=ids).logits
    assert made.trace.chosen[0].shape[-1] == 1
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_bad_records_are_refused_naming_what_is_wrong():
    _, _, info = moectl.load("tiny:olmoe", dtype="float32")
    layers, k, n = info.num_moe_layers, info.layers[0].top_k, info.layers[0].num_experts
    good = torch.zeros(5, layers, k, dtype=torch.long) + torch.arange(k)
    with pytest.raises(ConfigError, match=f"covers {layers + 1} MoE layers; the model has {layers}"):
        Replay(torch.zeros(5, layers + 1, k, dtype=torch.long) + torch.arange(k)).bind(info)
    bad = good.clone()
    bad[2, 1, 0] = n
    with pytest.raises(ConfigError, match=f"expert {n} at MoE layer 1 is out of range; valid ids are 0..{n - 1}"):
        Replay(bad).bind(info)
    twice = good.clone()
    twice[3, 0, 1] = twice[3, 0, 0]
    with pytest.raises(ConfigError, match="token 3 lists an expert twice at MoE layer 0"):
        Replay(twice)
    mixed = good.clone()
    mixed[1, 2, 0] = -1
    with pytest.raises(ConfigError, match="token 1 of MoE layer 2 mixes -1"):
        Replay(mixed)
    with pytest.raises(ConfigError, match="integer expert ids"):
        Replay(torch.zeros(5, layers, k))
    with pytest.raises(ConfigError, match=r"not a base64 \.npy"):
        Replay("not base64!")
    with pytest.raises(ConfigError, match="has no field 'tokens'"):
        load_policy({"type": "replay", "experts": good.tolist(), "tokens": 3}, info)
    with pytest.raises(ConfigError, match="start' must be an integer >= 0"):
        Replay(good, start=-1)


def test_the_policy_file_round_trips_and_takes_nested_lists():
    _, _, info = moectl.load("tiny:olmoe", dtype="float32")
    layers, k = info.num_moe_layers, info.layers[0].top_k
    experts = torch.randint(0, 2, (6, layers, 1)) * k + torch.arange(k)  # distinct per token
    policy = Replay(experts, start=2)
    back = load_policy(json.loads(json.dumps(policy.to_dict())), info)
    assert isinstance(back, Replay) and back.start == 2 and torch.equal(back.experts, policy.experts)
    nested = load_policy({"type": "replay", "experts": experts.tolist()}, info)  # vLLM's / SGLang's arrays
    assert torch.equal(nested.experts, policy.experts)
    assert torch.equal(load_policy({"type": "replay", "experts": encode(experts)}, info).experts, policy.experts)


@pytest.mark.parametrize("lean", [True, False])
def test_a_served_request_replayed_from_its_own_record_gives_the_same_tokens_and_logprobs(lean):
    model, tok, _ = moectl.load("tiny:olmoe", dtype="float32")
    routings = {"noisy": json.dumps({"type": "gumbel", "tau": 1.5})}
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2, return_routed_experts=True)
    prompts = ["Once upon a time", "def f(x):"]
    with Engine(model, tok, EngineConfig(max_batch=4, lean_decode=lean), routings=routings) as engine:
        rollouts = engine.generate(prompts, params, routing=["noisy", None])
        plain = engine.generate(prompts[:1], params)[0]
        replays = [Routing.of([Replay(c.routed_experts)], name="replay") for c in rollouts]
        again = engine.generate(prompts, params, routing=replays)  # the rollout's batch: bit for bit
        # beside another request (a batch of another shape: products may differ in the last bit)
        mixed = engine.generate([*prompts, "2 + 2 ="], params, routing=[*replays, None])
    assert rollouts[0].token_ids != plain.token_ids  # the noise changed the output
    for rollout, replay, beside in zip(rollouts, again, mixed, strict=False):
        assert replay.token_ids == rollout.token_ids == beside.token_ids
        assert [lp.logprob for lp in replay.logprobs] == [lp.logprob for lp in rollout.logprobs]
        assert torch.equal(replay.routed_experts, rollout.routed_experts)
        assert torch.equal(beside.routed_experts, rollout.routed_experts)


def test_a_client_replays_a_response_through_the_openai_client():
    import openai
    from fastapi.testclient import TestClient

    from moectl.engine.routed_experts import decode
    from moectl.server.app import create_app

    model, tok, info = moectl.load("tiny:olmoe", dtype="float32")
    engine = Engine(model, tok, EngineConfig(max_batch=4))
    test = TestClient(create_app(engine, "tiny:olmoe"))
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=test, max_retries=0)
    ask = {"max_tokens": 6, "temperature": 0, "logprobs": 1}
    with test:
        rollout = client.completions.create(
            model="tiny:olmoe", prompt="The mixture of experts", **ask,
            extra_body={"return_routed_experts": True, "ignore_eos": True, "routing": {"type": "gumbel", "tau": 2.0}},
        ).model_dump()["choices"][0]  # fmt: skip
        record = rollout["routed_experts"]
        answers = [
            client.completions.create(
                model="tiny:olmoe", prompt="The mixture of experts", **ask,
                extra_body={"return_routed_experts": True, "ignore_eos": True, "routing": {"type": "replay", "experts": experts}},
            ).model_dump()["choices"][0]
            for experts in (record, decode(record).tolist())  # moectl's/vLLM's base64 .npy, SGLang's nested lists
        ]
        bad = test.post("/v1/completions", json={
            "model": "tiny:olmoe", "prompt": "x", "max_tokens": 2,
            "routing": {"type": "replay", "experts": [[[0, 1]] * (info.num_moe_layers + 1)]},
        })  # fmt: skip
    for answer in answers:
        assert answer["text"] == rollout["text"]
        assert answer["logprobs"]["token_logprobs"] == rollout["logprobs"]["token_logprobs"]
        assert torch.equal(decode(answer["routed_experts"]), decode(record))
    assert bad.status_code == 400
    message = bad.json()["error"]["message"]
    assert f"covers {info.num_moe_layers + 1} MoE layers; the model has {info.num_moe_layers}" in message
