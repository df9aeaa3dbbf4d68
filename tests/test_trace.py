"""RoutingTrace: appending over decoding steps, segments, save and load."""

from __future__ import annotations

import torch

import moectl
from conftest import random_ids
from moectl.generate import Prompt, generate
from moectl.models.load import load_model
from moectl.routing import ExpertMask, RoutingTrace, route


@torch.no_grad()
def test_generation_appends_along_time():
    model, tok = load_model("tiny:qwen3_moe")
    prompts = [Prompt("hello there"), Prompt("a much longer prompt text")]
    with route(model, record=True) as session:
        generate(model, tok, prompts, max_new_tokens=5, progress=False)
    trace = session.trace  # inside a caller's session the engine decodes one prompt at a time
    width, short = len("a much longer prompt text"), len("hello there")
    assert trace.chosen[0].shape == (2, width + 4, 2)  # each prompt a segment; 4 decoding steps
    assert trace.prompt_len.tolist() == [short, width]
    assert trace.valid[0, : short + 4].all() and not trace.valid[0, short + 4 :].any()  # padded after
    assert trace.valid[1].all()


@torch.no_grad()
def test_segments_stack_along_batch_with_padding(olmoe):
    with route(olmoe, record=True) as session:
        olmoe(random_ids(batch=2, length=6))
        olmoe(random_ids(batch=1, length=9, seed=1))
    trace = session.trace
    assert trace.chosen[1].shape == (3, 9, 2)
    assert trace.valid.sum().item() == 2 * 6 + 9
    assert (trace.chosen[1][:2, 6:] == -1).all()


@torch.no_grad()
def test_save_and_load_round_trip(tmp_path, olmoe):
    info = moectl.inspect(olmoe)
    with route(olmoe, ExpertMask.from_lists(info, {1: [0, 2, 5]}), record=True) as session:
        olmoe(random_ids(batch=2, length=7))
    trace = session.trace
    trace.meta["note"] = "x"
    path = trace.save(tmp_path / "run" / "trace")
    loaded = RoutingTrace.load(path)
    assert loaded.meta["note"] == "x" and loaded.meta["family"] == "olmoe"
    for layer in range(3):
        assert torch.equal(loaded.chosen[layer], trace.chosen[layer])
        assert torch.equal(loaded.probs[layer], trace.probs[layer])
    assert sorted(loaded.allowed) == [1]
    assert torch.equal(loaded.allowed[1], trace.allowed[1])
    assert torch.equal(loaded.valid, trace.valid)
    assert not list((tmp_path / "run").glob("*.tmp"))
