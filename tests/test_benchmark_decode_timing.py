"""benchmarks/decode_timing.py: decode tokens/s counted inside one run, from the last prompt's first
token to the last token (never a difference of two runs, which noise can make negative)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import moectl
from _bench_helpers import bench
from moectl.engine import Engine, EngineConfig

decode_timing = bench("decode_timing")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ScriptedEngine:
    """Streams the events of a script of steps, the clock at each step's time."""

    def __init__(self, clock: Clock, steps: list[tuple[float, list[int]]]) -> None:
        self.clock, self.steps = clock, steps

    def generate(self, prompts, params, routing=None, on_event=None):
        for at, prompts_with_a_token in self.steps:
            self.clock.now = at
            for i in prompts_with_a_token:
                on_event(i, SimpleNamespace(token_ids=[7]))
        return []


def test_the_window_opens_at_the_last_prompts_first_token(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(decode_timing.time, "perf_counter", clock)
    # prompt 0 starts at 1.0 and makes a token at 2.0 before prompt 1 starts at 2.0; then 2 steps of both
    steps = [(1.0, [0]), (2.0, [0, 1]), (2.5, [0, 1]), (3.0, [0, 1])]
    got = decode_timing.decode_tok_s(ScriptedEngine(clock, steps), ["a", "b"], 4)
    assert got == pytest.approx(4 / 1.0)  # 4 tokens after 2.0, over 2.0 -> 3.0


def test_nothing_after_the_first_tokens_is_an_error_not_a_figure(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(decode_timing.time, "perf_counter", clock)
    with pytest.raises(RuntimeError, match="nothing to time"):
        decode_timing.decode_tok_s(ScriptedEngine(clock, [(1.0, [0, 1])]), ["a", "b"], 2)
    with pytest.raises(ValueError, match="at least 2"):
        decode_timing.decode_tok_s(ScriptedEngine(clock, []), ["a"], 1)


def test_a_real_engine_gives_a_positive_rate():
    model, tok, _ = moectl.load("tiny:olmoe")
    with Engine(model, tok, EngineConfig(max_batch=2)) as engine:
        assert decode_timing.decode_tok_s(engine, ["one", "two"], 3) > 0
