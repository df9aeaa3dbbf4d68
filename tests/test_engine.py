"""The engine: continuous batching equals solo generation, routing per row, sampling, streaming, limits."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

import moectl
from moectl.engine import (
    Engine,
    EngineConfig,
    QueueFull,
    RequestFailed,
    SamplingParams,
    UnbatchableCacheError,
)
from moectl.routing import route

PROMPTS = [
    "The history of the city of",
    "def f(x):",
    "2 + 2 = 4, and 3 + 3 = 6, and so on for a while longer than the others",
    "a",
    "Photosynthesis converts",
]
MASK = {"type": "expert_mask", "experts": {"0": [0, 1, 2, 3], "2": [4, 5, 6, 7]}}


@functools.cache
def _loaded(family: str):
    return moectl.load(f"tiny:{family}", dtype="float32")


def _offline(model, tok, prompt: str, n: int, policies=None) -> tuple[list[int], float]:
    """Greedy ``model.generate`` of one prompt under ``policies``; its tokens and switch rate."""
    with route(model, policies or [], record=True) as session:
        enc = tok([prompt], return_tensors="pt")
        out = model.generate(
            **enc, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=None
        )
    return out[0, enc["input_ids"].shape[1] :].tolist(), moectl.switch_rate(session.trace).mean


@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_batched_greedy_equals_solo_generate(family):
    """Rows joining and leaving a batch of 2 (5 prompts, different lengths) give model.generate's tokens;
    gpt-oss's sliding-window layers included (a prompt longer than its window of 64)."""
    model, tok, _ = _loaded(family)
    prompts = [*PROMPTS, "x" * 80]
    engine = Engine(model, tok, EngineConfig(max_batch=2))
    got = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    for prompt, completion in zip(prompts, got, strict=True):
        assert completion.token_ids == _offline(model, tok, prompt, 12)[0], prompt
        assert completion.finish_reason == "length"
    assert engine.stats()["prefills"] == len(prompts)


@pytest.mark.parametrize(
    "name,spec",
    [
        ("mask", MASK),
        ("gumbel", {"type": "gumbel", "tau": 1.0, "seed": 5}),
        ("pool", {"type": "document_pool", "d": 4}),
    ],
)
def test_each_row_routes_as_it_would_alone(name, spec):
    """Rows of one batch with a routing, another and none: each equals its solo run under route();
    the per-request switch rate equals moectl.switch_rate of the solo trace (per-request seed 5)."""
    model, tok, _ = _loaded("olmoe")
    engine = Engine(model, tok, EngineConfig(max_batch=4), routings={name: spec, "other": MASK})
    params = SamplingParams(max_tokens=10, ignore_eos=True, seed=5)
    ids, tokens, final = [], {}, {}

    def on_event(e):
        tokens.setdefault(e.request_id, []).extend(e.token_ids)
        if e.finish_reason:
            final[e.request_id] = e

    with engine:
        for i, prompt in enumerate(PROMPTS[:4]):
            routing = [name, None, name, "other"][i]
            ids.append((engine.submit(prompt, params, routing, on_event), prompt, routing))
        while len(final) < len(ids):
            engine.step()
    specs = {name: spec, "other": MASK, None: None}
    for rid, prompt, routing in ids:
        solo, rate = _offline(model, tok, prompt, 10, specs[routing])
        assert tokens[rid] == solo, (routing, prompt)
        assert final[rid].info["routing"] == routing
        if name != "mask" and routing == name:  # masks on some layers: see SwitchMeter's doc
            assert final[rid].info["switch_rate"] == pytest.approx(rate)


def test_controller_rows_keep_their_own_options():
    """A fresh (untrained) controller: each request forks it; batched rows equal solo runs."""
    model, tok, info = _loaded("olmoe")
    policy = moectl.options.ControllerPolicy(moectl.options.build_controller(info, k_hat=4), seed=0)
    engine = Engine(model, tok, EngineConfig(max_batch=3), routings={"ctrl": policy})
    got = engine.generate(PROMPTS[:3], SamplingParams(max_tokens=10, ignore_eos=True, seed=7), "ctrl")
    for prompt, completion in zip(PROMPTS[:3], got, strict=True):
        tokens, rate = _offline(model, tok, prompt, 10, [policy.fork(7)])
        assert completion.token_ids == tokens
        assert completion.switch_rate == pytest.approx(rate)


def test_sampling_depends_on_the_request_seed_only():
    model, tok, _ = _loaded("olmoe")
    engine = Engine(model, tok, EngineConfig(max_batch=4))
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    batched = [c.token_ids for c in engine.generate(PROMPTS[:4], params)]
    solo = [engine.generate([p], params)[0].token_ids for p in PROMPTS[:4]]
    assert batched == solo
    other = engine.generate(
        PROMPTS[:4], SamplingParams(max_tokens=10, temperature=0.8, seed=12, ignore_eos=True)
    )
    assert [c.token_ids for c in other] != batched


def test_stream_events_concatenate_to_the_text_and_stop_strings_cut():
    model, tok, _ = _loaded("olmoe")
    full = Engine(model, tok).generate(["abc"], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    stop = full.text[5:7]  # a stop string that occurs in the greedy text
    assert stop and full.text.find(stop) >= 0
    events = []
    engine = Engine(model, tok).start()
    try:
        rid = engine.submit(
            "abc", SamplingParams(max_tokens=30, stop=[stop], ignore_eos=True), on_event=events.append
        )
        engine.shutdown(drain=True)
    finally:
        engine.close()
    assert all(e.request_id == rid for e in events)
    text = "".join(e.text for e in events)
    assert text == full.text[: full.text.find(stop)]
    assert events[-1].finish_reason == "stop"
    assert sum(len(e.token_ids) for e in events) == events[-1].usage["completion_tokens"]


def test_an_event_per_token_with_its_text_held_back_where_it_may_stop():
    """Every generated token reaches on_event at its step: tokens that may begin a stop string come
    with no text, which follows once they cannot; the events concatenate to the text."""
    model, tok, _ = _loaded("olmoe")
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    full = Engine(model, tok).generate(["abc"], params)[0]
    stop = full.text[:3] + "\u2603"  # a prefix of the text, then a character it does not hold
    events = []
    with Engine(model, tok) as engine:
        engine.submit("abc", replace(params, stop=[stop]), on_event=events.append)
        while engine.stats()["running"] or engine.stats()["waiting"]:
            engine.step()
    assert [len(e.token_ids) for e in events] == [1] * 10
    assert events[0].text == "" and "".join(e.text for e in events) == full.text


def test_cancel_frees_the_row_at_the_next_step():
    model, tok, _ = _loaded("olmoe")
    engine = Engine(model, tok, EngineConfig(max_batch=2))
    events: list = []
    with engine:
        rid = engine.submit("abc", SamplingParams(max_tokens=500, ignore_eos=True), on_event=events.append)
        other = engine.submit("xyz", SamplingParams(max_tokens=3, ignore_eos=True))
        engine.step()
        engine.step()
        assert engine.stats()["running"] >= 1
        engine.cancel(rid)
        engine.step()
        assert any(e.finish_reason == "cancelled" for e in events)  # finished at that step
        while engine.stats()["running"]:
            engine.step()
    finals = [e for e in events if e.finish_reason]
    assert [e.finish_reason for e in finals] == ["cancelled"]
    assert finals[0].usage["completion_tokens"] < 500
    assert other


def test_bad_requests_are_refused_with_the_allowed_values():
    model, tok, _ = _loaded("olmoe")
    engine = Engine(model, tok, EngineConfig(max_batch=1, max_queue=2), routings={"math": MASK})
    with pytest.raises(ValueError, match="registered routings: math"):
        engine.submit("abc", routing="/etc/passwd")
    with pytest.raises(ValueError, match="context of 1024"):
        engine.submit("abc", SamplingParams(max_tokens=1023))
    for bad in ({"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"temperature": float("nan")}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    engine.submit("abc")
    engine.submit("abc")
    with pytest.raises(QueueFull):
        engine.submit("abc")
    with pytest.raises(ValueError, match="routing name"):
        Engine(model, tok, routings={"a b": MASK})


def test_models_whose_cache_cannot_be_rebatched_are_refused():
    model, tok, _ = _loaded("llama4_text")
    with pytest.raises(RequestFailed, match="chunked attention"):
        Engine(model, tok).generate(["abc"], SamplingParams(max_tokens=2))
    assert issubclass(UnbatchableCacheError, ValueError)


def test_offloaded_batch_equals_the_resident_model_and_counts_hits():
    from moectl.offload.offload_config import OffloadConfig

    model, tok, _ = _loaded("olmoe")
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    plain = [c.token_ids for c in Engine(model, tok).generate(PROMPTS[:4], params)]
    engine = Engine(model, tok, EngineConfig(max_batch=4, offload=OffloadConfig(budget=4, store="host")))
    with engine:
        got = [c.token_ids for c in engine.generate(PROMPTS[:4], params)]
        stats = engine.stats()["offload"]
    assert got == plain
    assert stats["hits"] + stats["misses"] > 0 and stats["loads"] == stats["misses"]
    assert all(p.device.type != "meta" for p in model.parameters())  # restored on close
    assert Engine(model, tok).generate(PROMPTS[:1], params)[0].token_ids == plain[0]


def test_roe_requests_equal_roe_generate_beside_plain_rows(tmp_path):
    """A RoE profile's requests (K = 4 samples over one clean cache, averaged) give moectl.roe.generate's
    tokens while plain rows run in the same steps and stay equal to their solo runs."""
    model, tok, _ = _loaded("olmoe")
    profile = tmp_path / "roe.json"
    profile.write_text('{"type": "roe", "format_version": 1, "K": 4, "tau": 0.5, "seed": 0}')
    prompts = PROMPTS[:3]
    reference = moectl.roe.generate(model, tok, prompts, str(profile), max_new_tokens=8, ignore_eos=True)
    engine = Engine(model, tok, EngineConfig(max_batch=4), routings={"roe": str(profile)})
    tokens, final = {}, {}

    def on_event(e):
        tokens.setdefault(e.request_id, []).extend(e.token_ids)
        if e.finish_reason:
            final[e.request_id] = e

    params = SamplingParams(max_tokens=8, ignore_eos=True)
    with engine:
        roe_ids = [engine.submit(p, params, "roe", on_event) for p in prompts]
        plain_ids = [engine.submit(p, params, None, on_event) for p in prompts]
        while len(final) < 6:
            engine.step()
    assert [tokens[i] for i in roe_ids] == [g.token_ids for g in reference]
    assert [tokens[i] for i in plain_ids] == [_offline(model, tok, p, 8)[0] for p in prompts]
    assert all(final[i].info["switch_rate"] is None for i in roe_ids)  # K routings: no one ω


def test_each_request_records_the_trace_it_would_record_alone():
    """EngineConfig.record: per-request traces, joined, equal route(record=True) around solo generate."""
    from moectl.routing.trace import RoutingTrace

    model, tok, _ = _loaded("olmoe")
    spec = {"type": "document_pool", "d": 4}
    engine = Engine(model, tok, EngineConfig(max_batch=3, record=True), routings={"pool": spec})
    got = engine.generate(PROMPTS[:4], SamplingParams(max_tokens=8, ignore_eos=True), "pool")
    joined = RoutingTrace.join([c.trace for c in got])
    solo = []
    for prompt in PROMPTS[:4]:
        with route(model, spec, record=True) as session:
            enc = tok([prompt], return_tensors="pt")
            model.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
        solo.append(session.trace)
    expected = RoutingTrace.join(solo)
    assert torch.equal(joined.valid, expected.valid) and torch.equal(joined.prompt_len, expected.prompt_len)
    for layer in range(3):
        assert torch.allclose(joined.probs[layer], expected.probs[layer])
        assert torch.equal(joined.chosen[layer], expected.chosen[layer])
        assert torch.equal(joined.allowed[layer], expected.allowed[layer])
    assert moectl.switch_rate(joined).mean == pytest.approx(moectl.switch_rate(expected).mean)


def test_left_pad_and_scored_positions():
    from moectl.lm.padding import left_pad, scored_positions

    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert scored_positions(mask, [1, 0]).tolist() == [[False, True, True], [False, False, True]]
    with pytest.raises(ValueError, match="at least one token"):
        left_pad([[1], []], pad_id=0)


def test_offloading_switches_to_eager_experts_and_back():
    """A model on grouped experts is offloaded with its experts' eager forward (what offloading runs),
    and gets its implementation back when the engine closes."""
    from moectl.offload.offload_config import OffloadConfig

    model, tok, _ = moectl.load("tiny:olmoe", dtype="float32")
    model.set_experts_implementation("grouped_mm")
    engine = Engine(model, tok, EngineConfig(offload=OffloadConfig(budget=4, store="host")))
    with engine:
        assert model.config._experts_implementation == "eager"
        got = engine.generate(["abc"], SamplingParams(max_tokens=4, ignore_eos=True))
    assert model.config._experts_implementation == "grouped_mm"
    assert got[0].finish_reason == "length"


def test_requests_admitted_together_are_prefilled_in_one_forward():
    """Five requests of different lengths and routings (a mask, Gumbel noise, a document pool, a
    controller, none) admitted at one step: ONE prefill forward for all five (left-padded), then
    each row equals its solo route() + model.generate run (float32)."""
    model, tok, info = _loaded("olmoe")
    controller = moectl.options.ControllerPolicy(moectl.options.build_controller(info, k_hat=4), seed=0)
    specs = {
        "mask": MASK,
        "gumbel": {"type": "gumbel", "tau": 1.0, "seed": 5},
        "pool": {"type": "document_pool", "d": 4},
        "ctrl": controller,
    }
    engine = Engine(model, tok, EngineConfig(max_batch=5, log_forwards=True), routings=specs)
    params = SamplingParams(max_tokens=8, ignore_eos=True, seed=3)
    order = ["gumbel", None, "ctrl", "mask", "pool"]
    prompts = [*PROMPTS[:2], "2 + 2 = 4, and 3 + 3 = 6", *PROMPTS[3:]]  # 1 to 26 tokens: one small forward
    assert len({len(tok([p])["input_ids"][0]) for p in prompts}) == 5  # lengths differ: padding
    tokens: dict[str, list[int]] = {}
    with engine:
        ids = [
            engine.submit(p, params, r, lambda e: tokens.setdefault(e.request_id, []).extend(e.token_ids))
            for p, r in zip(prompts, order, strict=True)
        ]
        while engine.stats()["running"] or engine.stats()["waiting"]:
            engine.step()
    assert engine.forward_log[0] == ("prefill", 5)
    assert [kind for kind, _ in engine.forward_log].count("prefill") == 1
    assert engine.stats()["prefill_forwards"] == 1 and engine.stats()["prefills"] == 5
    solo_policies = {None: None, "mask": MASK, "gumbel": specs["gumbel"], "pool": specs["pool"]}
    solo_policies["ctrl"] = [controller.fork(3)]
    for rid, prompt, routing in zip(ids, prompts, order, strict=True):
        assert tokens[rid] == _offline(model, tok, prompt, 8, solo_policies[routing])[0], routing


def test_a_request_that_fails_in_a_shared_prefill_fails_alone():
    """A routing whose policy raises: the shared prefill is redone one request at a time, so only
    that request ends with the error and the others equal their solo runs."""

    class Broken:
        def bind(self, info):
            pass

        def apply(self, state):
            raise ValueError("broken policy")

    model, tok, _ = _loaded("olmoe")
    engine = Engine(model, tok, EngineConfig(max_batch=3, log_forwards=True), routings={"broken": Broken()})
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    finals: list = []
    with engine:
        ids = [
            engine.submit(p, params, r, lambda e: e.finish_reason and finals.append(e))
            for p, r in zip(PROMPTS[:3], ["broken", None, None], strict=True)
        ]
        while len(finals) < 3 or engine.stats()["running"]:
            engine.step()
    assert engine.forward_log[:4] == [("prefill", 3), ("prefill", 1), ("prefill", 1), ("prefill", 1)]
    done = {e.request_id: e for e in finals}
    assert len(finals) == 3 and len(done) == 3  # each request finished once
    assert done[ids[0]].finish_reason == "error" and "broken policy" in done[ids[0]].info["error"]
    for i in (1, 2):
        assert done[ids[i]].finish_reason == "length"
        assert done[ids[i]].usage["completion_tokens"] == 6


def test_prefill_groups_bound_padding_and_size():
    from moectl.engine.batch import prefill_groups

    assert prefill_groups([5, 1, 30, 7], 2048) == [[0, 1, 2, 3]]  # small: one forward whatever the padding
    assert prefill_groups([500, 5, 5, 5], 2048) == [[0, 1], [2, 3]]  # padding stays at most half
    assert prefill_groups([600, 600, 600, 600], 2048) == [[0, 1, 2], [3]]  # 4 x 600 > 2048
    assert prefill_groups([3000, 2], 2048) == [[0], [1]]  # longer than the limit: alone
    assert prefill_groups([], 2048) == []


@pytest.mark.parametrize("threads", [2, None])
def test_the_loop_thread_runs_torch_with_the_configured_threads(threads):
    """OpenMP's thread count is per thread: ``start()``'s loop sets ``EngineConfig.threads`` (else
    the starting thread's count) in its own thread, so a server can load its model with one thread
    (``moectl serve``: two threads with OpenMP pools of several slowed the loop) and decode with more."""
    model, tok, _ = _loaded("olmoe")
    seen = []
    before = torch.get_num_threads()
    engine = Engine(model, tok, EngineConfig(threads=threads)).start()
    try:
        engine.submit("abc", SamplingParams(max_tokens=2), on_event=lambda e: seen.append(torch.get_num_threads()))
        engine.shutdown(drain=True)
    finally:
        engine.close()
    assert seen and set(seen) == {threads or before}
    assert torch.get_num_threads() == before  # the caller's own count is left as it was


def test_row_constant_routings_prepared_once_route_as_run_per_group(monkeypatch):
    """Masks, forced/omitted experts, topk:N and the option lens are prepared once per batch as tensors
    (``engine/row_constants.py``, #39 item 2): the same tokens, traces and switch rates as running each
    group's policies at every layer, beside rows of per-layer routings (noise, a pool)."""
    import json

    from moectl.engine import rows as engine_rows

    model, tok, info = moectl.load("tiny:qwen3_moe", dtype="float32")
    n = info.layers[0].num_experts
    routings = {
        "mask": json.dumps({"type": "expert_mask", "everywhere": list(range(n // 2))}),
        "force": json.dumps({"type": "experts", "force": {"0": [3]}, "omit": {"1": [0, 1]}}),
        "top2": "topk:2",
        "both": json.dumps([{"type": "topk", "n": 3}, {"type": "experts", "omit": {"0": [1]}}]),
        "opt6": "option:6",
        "noisy": json.dumps({"type": "gumbel", "tau": 1.0}),
        "pool": json.dumps({"type": "document_pool", "d": 4}),
    }
    order = [None, "mask", "force", "top2", "both", "opt6", "noisy", "pool"]
    prompts = [f"Prompt {i} about experts" for i in range(len(order))]
    params = SamplingParams(max_tokens=6, ignore_eos=True, seed=1)  # the noisy routing's draws seeded by it

    built: list[int] = []

    class Counted(engine_rows.ConstantRows):
        def __init__(self, groups, *args) -> None:
            built.append(len(groups))
            super().__init__(groups, *args)

    monkeypatch.setattr(engine_rows, "ConstantRows", Counted)

    def run() -> list:
        with Engine(model, tok, EngineConfig(max_batch=8, record=True), routings=routings) as engine:
            return engine.generate(prompts, params, routing=order)

    prepared = run()
    assert built and max(built) == 5  # mask, force, top2, both, opt6: prepared, not rebuilt every step
    assert len(built) < 6 * 3
    built.clear()
    monkeypatch.setattr(engine_rows, "row_effects", lambda policies, layers: None)
    per_group = run()
    assert not built  # every routing ran per group and layer
    for a, b in zip(prepared, per_group, strict=True):
        assert a.token_ids == b.token_ids and a.switch_rate == b.switch_rate
        for layer in range(info.num_moe_layers):
            assert torch.equal(a.trace.chosen[layer], b.trace.chosen[layer])
            assert (a.trace.allowed.get(layer) is None) == (b.trace.allowed.get(layer) is None)
            if a.trace.allowed.get(layer) is not None:
                assert torch.equal(a.trace.allowed[layer], b.trace.allowed[layer])
