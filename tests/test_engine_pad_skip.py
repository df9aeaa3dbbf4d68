"""A batched prefill's padding tokens skip the experts (engine/pad_skip.py); no token changes."""

from __future__ import annotations

import functools

import pytest

import moectl
from moectl.engine import Engine, EngineConfig, SamplingParams
from moectl.engine.pad_skip import real_tokens

PROMPTS = ["The history of the city of", "def f(x):", "2 + 2 = 4, and 3 + 3 = 6, and so on", "a"]


@functools.cache
def _loaded(family: str = "olmoe"):
    return moectl.load(f"tiny:{family}", dtype="float32")


def _run(config: EngineConfig, family: str = "olmoe") -> tuple[list[list[int]], list[int]]:
    """Greedy tokens of PROMPTS admitted together, and the rows each call of MoE layer 0's experts got."""
    model, tok, info = _loaded(family)
    engine = Engine(model, tok, config)
    rows: list[int] = []
    with engine:  # hooked after the engine's own hooks: sees what the experts are called with
        hook = info.layers[0].block.experts.register_forward_pre_hook(
            lambda m, args: rows.append(args[0].shape[0])
        )
        try:
            got = engine.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True))
        finally:
            hook.remove()
    return [c.token_ids for c in got], rows


def test_real_tokens_of_left_padded_rows():
    assert real_tokens([3, 1, 2], 3).tolist() == [0, 1, 2, 5, 7, 8]


@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3", "gpt_oss"])
def test_padding_skips_the_experts_and_no_token_changes(family):
    """Four prompts of different lengths prefilled in one forward: the experts get only the real tokens
    (Σ lengths rows, not 4 × the longest), and every generated token equals the run with padding."""
    _, tok, _ = _loaded(family)
    lengths = [len(tok([p])["input_ids"][0]) for p in PROMPTS]
    skipped, rows = _run(EngineConfig(max_batch=4), family)
    padded, rows_padded = _run(EngineConfig(max_batch=4, skip_padding=False), family)
    assert skipped == padded
    assert rows_padded[0] == 4 * max(lengths) and rows[0] == sum(lengths) < rows_padded[0]
    assert rows[1:] == rows_padded[1:] == [4] * 5  # decoding steps: no padding


def test_offloaded_experts_skip_padding_under_a_probs_policy():
    """Under the offload runtime (a residency policy that reads the router's probabilities) the
    offloaded experts get only the real tokens too, and the tokens equal the resident model's."""
    from moectl.offload.offload_config import OffloadConfig

    resident, _ = _run(EngineConfig(max_batch=4, skip_padding=False))
    offload = OffloadConfig(budget=6, store="host", policy="option:6")
    got, rows = _run(EngineConfig(max_batch=4, offload=offload))
    _, tok, _ = _loaded()
    assert got == resident
    assert rows[0] == sum(len(tok([p])["input_ids"][0]) for p in PROMPTS)
