"""Quantized models take the compiled decoding step: their quantized layers called as they are
(``moectl.lm.step_modules``), the rest of the step generated code.

The eager twin equals the model's own forward (int8 and int4, experts only and every projection,
the families with and without a shared expert); through the engine, compiled for real against the
lean forward: the same tokens and log-probabilities within bf16 rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch

import moectl
from moectl.adapters.inspect import inspect
from moectl.engine import Engine, EngineConfig, SamplingParams
from moectl.lm.compiled_decode import CompiledDecode
from moectl.lm.step_modules import ModuleCall
from moectl.lm.step_weights import step_weights
from moectl.routing.kv_cache import with_cache
from test_lean_decode import PROMPTS, _prefilled


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe"])
@pytest.mark.parametrize(("scheme", "scope"), [("int8", "experts"), ("int4", "all")])
def test_eager_twin_equals_the_quantized_models_forward(family, scheme, scope):
    model, _, _ = moectl.load(f"tiny:{family}", dtype="bfloat16", quantize=scheme, scope=scope)
    weights, why = step_weights(model, inspect(model))
    assert weights is not None, why
    moe = [w for w in weights.layers if w.router is not None]
    assert moe and all(isinstance(w.experts_call, ModuleCall) and w.gate_up is None for w in moe)
    assert isinstance(weights.layers[0].q, ModuleCall) == (scope == "all")
    step = CompiledDecode(weights, compile=False)
    cache, mask, positions = _prefilled(model, 2)
    token = torch.randint(3, 60, (2,))
    ours, theirs = copy.deepcopy(cache), copy.deepcopy(cache)
    with torch.no_grad():
        want = model(input_ids=token[:, None], attention_mask=mask, position_ids=positions, **with_cache(theirs),
                     use_cache=True).logits[:, -1]  # fmt: skip
        got, _, _, _ = step(token, mask, positions, ours)
    # the same layers on the same inputs; bf16 rounding where the step's sums differ in order
    torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_a_freed_models_layers_leave_the_registry():
    from moectl.lm import step_modules

    model, _, _ = moectl.load("tiny:olmoe", dtype="bfloat16", quantize="int4", scope="all")
    weights, _ = step_weights(model, inspect(model))
    key = weights.layers[0].q.key
    assert step_modules._MODULES.get(key) is model.model.layers[0].self_attn.q_proj
    del model, weights
    import gc

    gc.collect()
    assert step_modules._MODULES.get(key) is None
    with pytest.raises(RuntimeError, match="is gone"):
        step_modules._module(key)


def test_engine_compiled_for_real_equals_the_lean_forward_on_an_int4_model():
    """torch.compile itself, rows of different lengths decoding together and leaving: greedy tokens
    equal and log-probabilities within bf16 rounding."""
    torch._dynamo.reset()
    model, tok, _ = moectl.load("tiny:olmoe", dtype="bfloat16", quantize="int4", scope="all")
    runs = {}
    for compile_decode in (True, False):
        params = [SamplingParams(max_tokens=3 + 4 * i, ignore_eos=True, temperature=0, logprobs=1) for i in range(3)]
        with Engine(model, tok, EngineConfig(max_batch=3, compile_decode=compile_decode)) as engine:
            runs[compile_decode] = engine.generate(PROMPTS[:3], params)
            stats = engine.stats()["decode_forward"]
        if compile_decode:
            assert stats["compiled"] > 0 and stats["slow"] == {} and "lean" not in stats, stats
    for got, want in zip(runs[True], runs[False], strict=True):
        assert got.token_ids == want.token_ids
        assert [x.logprob for x in got.logprobs] == pytest.approx([x.logprob for x in want.logprobs], abs=0.05)
