"""The lean decoding forward (moectl.lm.lean_decode) computes what the model's own forward computes.

Bit for bit, per family it covers: final hidden states and the KV cache after one token per row,
with and without left padding, in bf16 and fp32; and through the engine (``EngineConfig.lean_decode``
on against off): the same tokens, traces and switch rates for every routing kind, rows joining and
leaving mid-run. Where it does not apply (a family without one, hooks on a decoder layer) the
model's own forward decodes and the engine says so.
"""

from __future__ import annotations

import copy

import pytest
import torch

import moectl
from moectl.engine import Engine, EngineConfig, SamplingParams
from moectl.lm.lean_decode import FAMILIES, lean_decode
from moectl.routing.kv_cache import with_cache

COVERED = ["olmoe", "qwen2_moe", "qwen3_moe", "mixtral"]
MASK = {"type": "expert_mask", "experts": {"0": [0, 1, 2, 3], "1": [4, 5, 6, 7]}}
PROMPTS = ["The mixture of experts routes", "def f(x):", "2 + 2 = 4, and 3 + 3 = 6, so", "Once"]


def _prefilled(model, batch: int, length: int = 12):
    from transformers import DynamicCache

    torch.manual_seed(0)
    ids = torch.randint(3, 60, (batch, length))
    mask = torch.ones(batch, length + 1, dtype=torch.long)
    if batch > 1:
        mask[0, :4] = 0  # left padding in the first row
    cache = DynamicCache(config=model.config)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask[:, :-1], position_ids=positions[:, :-1], **with_cache(cache),
              use_cache=True)  # fmt: skip
    return cache, mask, positions[:, -1:]


@pytest.mark.parametrize("family", COVERED)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 3])
def test_equals_the_models_forward_bit_for_bit(family, dtype, batch):
    model, _, _ = moectl.load(f"tiny:{family}", dtype=dtype)
    lean, why = lean_decode(model)
    assert lean is not None, why
    cache, mask, positions = _prefilled(model, batch)
    token = torch.randint(3, 60, (batch, 1))
    ours, theirs = copy.deepcopy(cache), copy.deepcopy(cache)
    with torch.no_grad():
        want = model.model(input_ids=token, attention_mask=mask, position_ids=positions, **with_cache(theirs),
                           use_cache=True).last_hidden_state  # fmt: skip
        got = lean.forward(token, mask, positions, ours)
    assert torch.equal(got, want)
    for a, b in zip(ours.layers, theirs.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_installed_forward_is_the_models_outside_its_calls_and_restored():
    """Inside ``installed()`` a one-token call takes the lean forward, a prefill the model's own; the
    base model's own forward (or an instance forward someone else set) is back afterwards."""
    model, _, _ = moectl.load("tiny:olmoe", dtype="float32")
    lean, _ = lean_decode(model)
    base = model.model
    assert "forward" not in base.__dict__
    cache, mask, positions = _prefilled(model, 2)
    calls: dict[str, int] = {}
    with torch.no_grad(), lean.installed(calls):
        model(input_ids=torch.tensor([[5], [6]]), attention_mask=mask, position_ids=positions,
              **with_cache(cache), use_cache=True)  # fmt: skip
        model(input_ids=torch.tensor([[5, 6, 7]]))  # a prefill: the model's own forward
    assert calls == {"lean": 1, "model": 1}
    assert "forward" not in base.__dict__
    mine = base.forward  # an instance forward set by someone else stays theirs
    base.forward = mine
    with lean.installed():
        assert base.__dict__["forward"] is not mine
    assert base.__dict__["forward"] is mine


def test_hooks_on_a_decoder_layer_keep_the_models_forward():
    """A hook on a decoder layer or attention module would not fire in the lean forward: such calls
    take the model's own forward, and the hook sees every layer call."""
    model, _, _ = moectl.load("tiny:olmoe", dtype="float32")
    lean, _ = lean_decode(model)
    seen = []
    handle = model.model.layers[0].self_attn.register_forward_hook(lambda *a: seen.append(1))
    try:
        cache, mask, positions = _prefilled(model, 1)
        seen.clear()
        assert lean.covers(torch.tensor([[5]]), cache, mask) is not None
        calls: dict[str, int] = {}
        with torch.no_grad(), lean.installed(calls):
            model(input_ids=torch.tensor([[5]]), attention_mask=mask, position_ids=positions,
                  **with_cache(cache), use_cache=True)  # fmt: skip
        assert calls == {"model": 1} and seen == [1]
    finally:
        handle.remove()


def test_a_family_without_one_decodes_through_the_model_and_says_why():
    assert "deepseek_v3" not in FAMILIES
    model, tok, _ = moectl.load("tiny:deepseek_v3", dtype="float32")
    lean, why = lean_decode(model)
    assert lean is None and "deepseek_v3" in why
    with Engine(model, tok) as engine:
        engine.generate(["abc"], SamplingParams(max_tokens=3, ignore_eos=True))
        forward = engine.stats()["decode_forward"]
    assert forward["path"] == why and forward.get("lean", 0) == 0 and forward["model"] == 2


def _run(model, tok, lean: bool, routings, order, record: bool = True):
    """Requests joining at different steps and leaving at different lengths (a batch that changes)."""
    config = EngineConfig(max_batch=3, record=record, lean_decode=lean)
    engine = Engine(model, tok, config, routings=routings)
    out: dict[int, list[int]] = {}
    with engine:
        ids = []
        for i, routing in enumerate(order):
            params = SamplingParams(max_tokens=4 + 3 * i, ignore_eos=True, seed=i, temperature=0.8)
            ids.append(engine.submit(PROMPTS[i % len(PROMPTS)], params, routing, lambda e, i=i: out.setdefault(
                i, []).extend(e.token_ids)))  # fmt: skip
            engine.step()
        while engine.stats()["running"] or engine.stats()["waiting"]:
            engine.step()
        stats = engine.stats()
    return out, stats


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe"])
def test_engine_lean_and_model_forwards_agree_for_every_routing(family):
    model, tok, info = moectl.load(f"tiny:{family}", dtype="bfloat16")
    controller = moectl.options.ControllerPolicy(moectl.options.build_controller(info, k_hat=4), seed=0)
    routings = {
        "mask": MASK,
        "gumbel": {"type": "gumbel", "tau": 1.0, "seed": 5},
        "pool": {"type": "document_pool", "d": 4},
        "ctrl": controller,
        "opt": "option:4",
    }
    order = ["gumbel", None, "ctrl", "mask", "pool", "opt", None]
    lean_out, lean_stats = _run(model, tok, True, routings, order)
    model_out, model_stats = _run(model, tok, False, routings, order)
    assert lean_stats["decode_forward"].get("lean", 0) > 0 and "lean" not in model_stats["decode_forward"]
    assert lean_out == model_out
    assert lean_stats["switch_rate"] == model_stats["switch_rate"]


def test_engine_traces_equal_under_both_forwards():
    model, tok, _ = moectl.load("tiny:qwen3_moe", dtype="bfloat16")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    got = []
    for lean in (True, False):
        with Engine(model, tok, EngineConfig(record=True, lean_decode=lean)) as engine:
            got.append(engine.generate(PROMPTS[:3], params))
    for a, b in zip(*got, strict=True):
        assert a.token_ids == b.token_ids
        for layer in range(len(a.trace.chosen)):
            assert torch.equal(a.trace.chosen[layer], b.trace.chosen[layer])
            assert torch.equal(a.trace.probs[layer], b.trace.probs[layer])
