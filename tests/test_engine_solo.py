"""``EngineConfig(solo=True)``: one request at a time, its cache the model's own, never padded or re-batched.

Models whose cache the engine cannot re-batch (recurrent or linear-attention layers, chunked
attention, a cache class of their own: ``kv.batchable`` is False) still run on the engine this way,
and decode what ``model.generate`` decodes; ``moectl eval`` generation uses it for them.
"""

from __future__ import annotations

import functools

import pytest
import torch

import moectl
from moectl.engine import Engine, EngineConfig, SamplingParams
from moectl.engine.kv import batchable
from moectl.eval.eval_generation import GenSettings, generate_texts
from moectl.eval.forward import static_plan
from moectl.models.tokens import encode

PROMPTS = ["The history of the city of", "def f(x):", "a"]


@functools.cache
def _loaded(family: str):
    model, tok, _ = moectl.load(f"tiny:{family}", dtype="float32")
    return model, tok


def _generate(model, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    out = model.generate(
        input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, eos_token_id=None
    )
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("family,expected", [("olmoe", True), ("llama4_text", False), ("minimax", False)])
def test_batchable_tells_which_caches_the_engine_can_rebatch(family, expected):
    assert batchable(_loaded(family)[0]) is expected


@pytest.mark.parametrize("family", ["llama4_text", "minimax", "qwen3_next"])
def test_solo_engine_decodes_what_generate_does(family):
    model, tok = _loaded(family)
    engine = Engine(model, tok, EngineConfig(max_batch=4, solo=True, log_forwards=True))
    got = engine.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True))
    for prompt, completion in zip(PROMPTS, got, strict=True):
        assert completion.token_ids == _generate(model, tok([prompt])["input_ids"][0].tolist(), 6), prompt
    assert {rows for _, rows in engine.forward_log} == {1}, "one request at a time"


def test_eval_generation_runs_unbatchable_models():
    model, tok = _loaded("minimax")
    contexts = ["The cat sat", "a", "Q: hi\nA:"]
    texts = generate_texts(
        model, tok, contexts, GenSettings((), 5), static_plan([]), moectl.inspect(model), 2
    )
    expected = [tok.decode(_generate(model, encode(tok, c), 5), skip_special_tokens=True) for c in contexts]
    assert texts == expected
