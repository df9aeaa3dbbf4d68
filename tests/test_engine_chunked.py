"""Chunked prefill: a long prompt fed over several steps equals one-shot prefill, and running rows
keep decoding meanwhile."""

from __future__ import annotations

import functools

import pytest
import torch

import moectl
from moectl.engine import Engine, EngineConfig, SamplingParams
from moectl.errors import ConfigError

LONG = "The history of the city of Rome is long, and it began with a village on a hill by the river; later"
MASK = {"type": "expert_mask", "experts": {"0": [0, 1, 2, 3], "2": [4, 5, 6, 7]}}


@functools.cache
def _loaded():
    return moectl.load("tiny:olmoe", dtype="float32")


def _routings(info) -> dict:
    controller = moectl.options.build_controller(info, k_hat=4)
    return {
        "mask": MASK,
        "pool": {"type": "document_pool", "d": 4},
        "ctrl": moectl.options.ControllerPolicy(controller, mode="greedy"),
        "gumbel": {"type": "gumbel", "tau": 1.0, "seed": 5},
    }


def _run(chunk: int, routing: str | None, record: bool = False):
    model, tok, info = _loaded()
    config = EngineConfig(max_batch=2, prefill_chunk=chunk, log_forwards=True, record=record)
    engine = Engine(model, tok, config, routings=_routings(info))
    params = SamplingParams(max_tokens=10, ignore_eos=True, seed=3)
    got = engine.generate([LONG, "abc"], params, routing)
    return got, engine


@pytest.mark.parametrize("routing", [None, "mask", "pool", "ctrl", "gumbel"])
def test_chunked_prefill_equals_one_forward(routing):
    """98 tokens in chunks of 16 (7 forwards) give the tokens and switch rates of one prefill forward,
    under each routing; Gumbel noise (drawn in call order) is prefilled in one forward instead."""
    whole, one = _run(4096, routing)
    chunked, many = _run(16, routing)
    assert [c.token_ids for c in chunked] == [c.token_ids for c in whole]
    assert [c.switch_rate for c in chunked] == pytest.approx([c.switch_rate for c in whole])
    kinds = [kind for kind, _ in many.forward_log]
    assert kinds.count("chunk") == (0 if routing == "gumbel" else 7)
    assert [kind for kind, _ in one.forward_log].count("chunk") == 0
    assert many.stats()["prefills"] == 2


def test_chunked_prefill_records_the_trace_of_one_forward():
    from moectl.routing.trace import RoutingTrace

    whole, _ = _run(4096, "pool", record=True)
    chunked, _ = _run(16, "pool", record=True)
    a = RoutingTrace.join([c.trace for c in whole])
    b = RoutingTrace.join([c.trace for c in chunked])
    assert torch.equal(a.valid, b.valid) and torch.equal(a.prompt_len, b.prompt_len)
    for layer in range(a.num_layers):
        assert torch.allclose(a.probs[layer], b.probs[layer], atol=1e-5)
        assert torch.equal(a.chosen[layer], b.chosen[layer])
        assert torch.equal(a.allowed[layer], b.allowed[layer])


def test_running_rows_decode_between_chunks():
    """A request running when a long prompt arrives gets a token at every step of its chunked prefill:
    the forwards alternate chunk, decode, chunk, decode ...; then both rows decode together."""
    model, tok, _ = _loaded()
    engine = Engine(model, tok, EngineConfig(max_batch=2, prefill_chunk=16, log_forwards=True))
    tokens: dict[str, list[int]] = {}

    def on_event(e):
        tokens.setdefault(e.request_id, []).extend(e.token_ids)

    with engine:
        short = engine.submit("abc", SamplingParams(max_tokens=20, ignore_eos=True), on_event=on_event)
        engine.step()
        long = engine.submit(LONG, SamplingParams(max_tokens=4, ignore_eos=True), on_event=on_event)
        while engine.stats()["running"]:
            engine.step()
    log = engine.forward_log
    assert log[:2] == [("prefill", 1), ("decode", 1)]
    assert log[2:16] == [("chunk", 1), ("decode", 1)] * 6 + [("chunk", 1), ("decode", 2)]
    assert len(tokens[long]) == 4 and len(tokens[short]) == 20


def test_cancel_during_chunked_prefill_frees_it():
    model, tok, _ = _loaded()
    engine = Engine(model, tok, EngineConfig(max_batch=1, prefill_chunk=16, log_forwards=True))
    finals: list = []
    with engine:
        rid = engine.submit(LONG, SamplingParams(max_tokens=5), on_event=finals.append)
        engine.step()
        engine.step()
        assert engine.stats()["running"] == 1
        engine.cancel(rid)
        engine.step()
        assert engine.stats()["running"] == 0
        after = engine.generate(["abc"], SamplingParams(max_tokens=3, ignore_eos=True))  # its slot is free
    assert [e.finish_reason for e in finals] == ["cancelled"]
    assert finals[0].usage["completion_tokens"] == 0
    assert engine.forward_log[:2] == [("chunk", 1), ("chunk", 1)]
    assert len(after[0].token_ids) == 3


def test_prefill_chunk_is_checked():
    with pytest.raises(ConfigError, match="prefill_chunk"):
        EngineConfig(prefill_chunk=0)


def test_chunked_prefill_under_the_offload_runtime_equals_the_resident_model():
    from moectl.offload.offload_config import OffloadConfig

    model, tok, _ = _loaded()
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    resident = Engine(model, tok, EngineConfig(max_batch=2, prefill_chunk=4096)).generate(
        [LONG, "abc"], params
    )
    config = EngineConfig(max_batch=2, prefill_chunk=16, offload=OffloadConfig(budget=4, store="host"))
    offloaded = Engine(model, tok, config).generate([LONG, "abc"], params)
    assert [c.token_ids for c in offloaded] == [c.token_ids for c in resident]


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])
def test_chunked_prefill_equals_one_forward_in_other_families(family):
    """gpt-oss's sliding-window layers (window 64 < the 196-token prompt, chunks of 16 and 50) and
    DeepSeek-V3's attention build the same cache chunk by chunk."""
    model, tok, _ = moectl.load(f"tiny:{family}", dtype="float32")
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = [LONG * 2, "abc"]
    runs = [
        [
            c.token_ids
            for c in Engine(model, tok, EngineConfig(max_batch=2, prefill_chunk=n)).generate(prompts, params)
        ]
        for n in (4096, 16, 50)
    ]
    assert runs[0] == runs[1] == runs[2]
