"""RoE requests in the engine: one ensemble per routing, rows joining and leaving (engine/roe_rows.py)."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from torch import Tensor

import moectl
from moectl.engine import Engine, EngineConfig, SamplingParams
from moectl.engine.engine import encode
from moectl.ensemble.ensemble import Ensemble
from moectl.errors import ConfigError
from moectl.roe import RoEConfig

PROMPTS = [
    "The history of the city of",
    "def f(x):",
    "2 + 2 = 4, and 3 + 3 = 6, and so on for a while longer than the others",
    "a",
    "Photosynthesis converts",
]
NOISY = RoEConfig(K=4, tau=0.5, seed=1)


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def _loaded(family: str = "olmoe"):
    return moectl.load(f"tiny:{family}", dtype="float32")


@functools.cache
def _reference(prompt: str, config: RoEConfig = NOISY, n: int = 8, family: str = "olmoe") -> list[int]:
    """Greedy tokens of ``prompt`` from an ``Ensemble`` of its own (one row: the definition)."""
    model, tok, _ = _loaded(family)
    ids = torch.tensor([encode(tok, prompt)])
    tokens = []
    with Ensemble(model, config) as ens:
        out = ens.start(ids, torch.ones_like(ids))
        for i in range(n):
            token = out.logprobs.argmax(-1)
            tokens.append(int(token))
            if i < n - 1:
                out = ens.step(token)
    return tokens


class Events:
    """Collects each request's events: its tokens and its final event."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.final: dict[str, object] = {}

    def __call__(self, event) -> None:
        self.tokens.setdefault(event.request_id, []).extend(event.token_ids)
        if event.finish_reason:
            self.final[event.request_id] = event


def _engine(max_batch: int, routings=None, family: str = "olmoe") -> Engine:
    model, tok, _ = _loaded(family)
    config = EngineConfig(max_batch=max_batch, log_forwards=True)
    return Engine(model, tok, config, routings=routings or {"roe": NOISY})


def test_a_batch_of_roe_requests_equals_each_alone():
    """Five prompts of different lengths share one ensemble (one prefill, one forward per step for all)
    and each gets the tokens it gets alone and from its own Ensemble."""
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    batched = _engine(8)
    got = [c.token_ids for c in batched.generate(PROMPTS, params, "roe")]
    log = batched.forward_log  # prefilled in a forward or two (batch.prefill_groups), decoded as one
    assert sum(rows for kind, rows in log if kind == "prefill") == 5
    assert [entry for entry in log if entry[0] == "decode"] == [("decode", 5)] * 7
    alone = [_engine(1).generate([p], params, "roe")[0].token_ids for p in PROMPTS]
    assert got == alone == [_reference(p) for p in PROMPTS]


@pytest.mark.parametrize("cache", ["clean", "separate", "none"])
def test_roe_rows_join_mid_way_and_leave_at_their_own_length(cache):
    """Requests of different lengths and max_tokens: later ones join the running ensemble between steps
    (left-padded cache rows), finished ones leave it; every request keeps its solo tokens. Each way of
    running the K samples: one clean cache (RoE §2.3), K caches per prompt, no cache."""
    config = NOISY.with_(cache=cache)
    engine, events = _engine(3, {"roe": config}), Events()
    lengths = [3, 8, 5, 8, 6]

    def submit(first: int, last: int) -> list[str]:
        params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths[first:last]]
        return [engine.submit(p, q, "roe", events) for p, q in zip(PROMPTS[first:last], params, strict=True)]

    with engine:
        ids = submit(0, 2)
        engine.step()
        engine.step()
        ids += submit(2, 5)
        while len(events.final) < 5:
            engine.step()
    for rid, prompt, n in zip(ids, PROMPTS, lengths, strict=True):
        assert events.tokens[rid] == _reference(prompt, config)[:n], prompt
        assert events.final[rid].finish_reason == "length"
    log = engine.forward_log
    assert log[:3] == [("prefill", 2), ("decode", 2), ("decode", 2)]
    assert ("prefill", 1) in log[3:] and ("decode", 3) in log  # joined a running group
    assert max(rows for _, rows in log) == 3


def test_cancel_frees_the_roe_rows():
    engine, events = _engine(4), Events()
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    with engine:
        ids = [engine.submit(p, params, "roe", events) for p in PROMPTS[:3]]
        engine.step()
        engine.cancel(ids[1])
        engine.step()
        assert events.final[ids[1]].finish_reason == "cancelled"
        (group,) = engine._roe_rows.groups
        assert [r.id for r in group.reqs] == [ids[0], ids[2]]
        assert group.ensemble.variant.valid.shape[0] == 2
        assert all(layer.keys.shape[0] == 2 for layer in group.ensemble.variant.cache.layers)
        while len(events.final) < 3:
            engine.step()
    assert events.tokens[ids[0]] == _reference(PROMPTS[0]) and events.tokens[ids[2]] == _reference(PROMPTS[2])
    assert not engine._roe_rows.groups


def test_sampled_roe_tokens_do_not_depend_on_batch_mates():
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5)
    got = [c.token_ids for c in _engine(8).generate(PROMPTS, params, "roe", seed_per_prompt=True)]
    for i, prompt in enumerate(PROMPTS):
        alone = _engine(1).generate(
            [prompt], SamplingParams(max_tokens=8, temperature=1.0, seed=5 + i), "roe"
        )
        assert got[i] == alone[0].token_ids


def test_two_roe_routings_run_as_two_ensembles():
    engine, events = _engine(8, {"a": NOISY, "b": NOISY.with_(seed=2)}), Events()
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with engine:
        ids = [engine.submit(p, params, name, events) for name in ("a", "b") for p in PROMPTS[:2]]
        while len(events.final) < 4:
            engine.step()
    expected = [_reference(p, config, 6) for config in (NOISY, NOISY.with_(seed=2)) for p in PROMPTS[:2]]
    assert [events.tokens[i] for i in ids] == expected
    assert engine.forward_log[:4] == [("prefill", 2), ("prefill", 2), ("decode", 2), ("decode", 2)]


def test_hybrid_models_run_one_ensemble_per_request():
    """Recurrent states (qwen3_next's linear attention) are not re-batched: each request its own."""
    config = RoEConfig(K=3, tau=0.3)
    engine = _engine(4, {"roe": config}, family="qwen3_next")
    got = engine.generate(PROMPTS[:3], SamplingParams(max_tokens=4, ignore_eos=True), "roe")
    assert [c.token_ids for c in got] == [_reference(p, config, 4, "qwen3_next") for p in PROMPTS[:3]]
    assert max(rows for _, rows in engine.forward_log) == 1


def _adaptive_reference(prompt: str, threshold: float, n: int) -> tuple[list[int], Tensor]:
    """Greedy tokens of an AdaptiveEnsemble of its own, and the clean entropies it saw."""
    from moectl.ensemble.adaptive_ensemble import AdaptiveEnsemble

    model, tok, _ = _loaded("olmoe")
    ids = torch.tensor([encode(tok, prompt)])
    tokens = []
    with AdaptiveEnsemble(model, NOISY, threshold) as ens:
        out = ens.start(ids, torch.ones_like(ids))
        for _ in range(n):
            tokens.append(int(out.logprobs.argmax(-1)))
            out = ens.step(out.logprobs.argmax(-1))
    return tokens, torch.cat(ens.entropies)


def test_adaptive_k_rows_join_mid_way():
    """Adaptive K (AdaptiveEnsemble: noisy samples only on uncertain rows) through the engine: requests
    joining a running ensemble get the tokens of their own AdaptiveEnsemble."""
    from dataclasses import replace

    lengths = (3, 7, 6, 6)
    seen = torch.cat([_adaptive_reference(p, 0.0, n)[1] for p, n in zip(PROMPTS, lengths, strict=False)])
    threshold = float(seen.median())  # some tokens above it (K samples), some below (the clean one)
    engine, events = _engine(3), Events()
    engine.routings["roe"] = replace(engine.routings["roe"], adaptive=threshold)
    with engine:
        ids = [engine.submit(p, SamplingParams(max_tokens=n, ignore_eos=True), "roe", events)
               for p, n in zip(PROMPTS[:2], lengths[:2], strict=True)]  # fmt: skip
        engine.step()
        ids += [engine.submit(p, SamplingParams(max_tokens=n, ignore_eos=True), "roe", events)
                for p, n in zip(PROMPTS[2:4], lengths[2:], strict=True)]  # fmt: skip
        while len(events.final) < 4:
            engine.step()
    assert ("decode", 3) in engine.forward_log
    for rid, prompt, n in zip(ids, PROMPTS, lengths, strict=False):
        assert events.tokens[rid] == _adaptive_reference(prompt, threshold, n)[0], prompt
    assert 1 < engine.stats()["roe_sample_tokens"] / engine.stats()["generated_tokens"] < NOISY.K


@pytest.fixture
def bad_prompts_fail(monkeypatch):
    """An ensemble's prefill fails when its prompts hold the token of "!" (the others start as ever)."""
    _, tok, _ = _loaded("olmoe")
    bad = encode(tok, "!")[-1]
    start = Ensemble.start

    def failing_start(self, input_ids, attention_mask=None):
        if bool((input_ids == bad).any()):
            raise RuntimeError("bad prompt")
        return start(self, input_ids, attention_mask)

    monkeypatch.setattr(Ensemble, "start", failing_start)


def test_a_failing_shared_prefill_fails_only_the_bad_request(bad_prompts_fail):
    """A prefill of several RoE requests that fails is redone one by one: only the bad one fails."""
    engine, events = _engine(4), Events()
    with engine:
        ids = [
            engine.submit(p, SamplingParams(max_tokens=4, ignore_eos=True), "roe", events)
            for p in ("good", "bad!")
        ]
        while len(events.final) < 2:
            engine.step()
    assert (
        events.final[ids[1]].finish_reason == "error" and "bad prompt" in events.final[ids[1]].info["error"]
    )
    assert events.final[ids[0]].finish_reason == "length"
    assert events.tokens[ids[0]] == _reference("good", NOISY, 4)


def test_a_failing_prefill_leaves_the_running_roe_rows_alone(bad_prompts_fail):
    """A bad RoE request admitted alone while others run fails by itself; the running ones go on."""
    engine, events = _engine(4), Events()
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    with engine:
        good = engine.submit("good", params, "roe", events)
        engine.step()
        failing = engine.submit("bad!", params, "roe", events)
        while len(events.final) < 2:
            engine.step()
    assert events.final[failing].finish_reason == "error"
    assert events.final[good].finish_reason == "length" and events.tokens[good] == _reference(
        "good", NOISY, 5
    )


def test_a_roe_request_returns_its_k_samples_routed_experts_the_clean_one_the_models():
    """``return_routed_experts`` on a RoE request (#41 item 1): [K, tokens, MoE layers, k], the clean
    prefix the same in every copy, copy 0 (the clean sample) the model's own routing of the tokens,
    the noisy copies their own; requests that do not ask, in the same ensemble, carry none."""
    model, tok, info = moectl.load("tiny:olmoe", dtype="float32")
    routings = {"roe": json.dumps({"tau": [1.0] * info.num_moe_layers, "K": 3})}
    ask = SamplingParams(max_tokens=5, ignore_eos=True, return_routed_experts=True)
    quiet = SamplingParams(max_tokens=5, ignore_eos=True)
    prompts = ["The mixture of experts routes", "Hi", "Once upon a time"]
    with Engine(model, tok, EngineConfig(max_batch=4), routings=routings) as engine:
        done = engine.generate(prompts, [ask, quiet, ask], routing="roe")
    assert done[1].routed_experts is None
    for completion in (done[0], done[2]):
        experts = completion.routed_experts
        n = completion.prompt_tokens + len(completion.token_ids) - 1
        assert experts.shape == (3, n, info.num_moe_layers, info.layers[0].top_k)
        prefix = completion.prompt_tokens - 1
        assert torch.equal(experts[1, :prefix], experts[0, :prefix]) and torch.equal(experts[2, :prefix], experts[0, :prefix])
        ids = encode(tok, prompts[done.index(completion)]) + completion.token_ids[:-1]
        with moectl.route(model, record=True) as clean, torch.no_grad():
            model(torch.tensor([ids]))
        want = torch.stack([clean.trace.chosen[layer][0] for layer in range(info.num_moe_layers)], 1)
        assert torch.equal(experts[0].long(), want)
        assert not torch.equal(experts[1, prefix:], experts[0, prefix:])  # the noisy samples route otherwise


def test_routed_experts_of_a_roe_routing_without_the_clean_cache_are_refused():
    model, tok, info = moectl.load("tiny:olmoe", dtype="float32")
    routings = {"sep": json.dumps({"tau": [1.0] * info.num_moe_layers, "K": 2, "cache": "separate"})}
    with Engine(model, tok, routings=routings) as engine, pytest.raises(ConfigError, match="needs its clean cache"):
        engine.generate(["Hi"], SamplingParams(max_tokens=2, return_routed_experts=True), routing="sep")
