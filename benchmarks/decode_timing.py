"""Decode tokens/s of an engine run, timed inside the run: the benchmarks' one way to time decoding.

The tokens each prompt makes after every prompt has its first one (the prefill's), over the time
from that moment to the last token, from the events ``Engine.generate`` streams. Timing a
one-token run and subtracting it from a longer one, as the benchmarks did, compares two runs: with
few tokens, noise between them can exceed their difference (a negative tokens/s).
"""

from __future__ import annotations

import time
from typing import Any

from moectl.engine import Engine, SamplingParams


def decode_tok_s(engine: Engine, prompts: list[str], tokens: int, routing: Any = None) -> float:
    """Tokens/s of ``tokens`` greedy tokens per prompt (EOS ignored), after the first tokens."""
    if tokens < 2:
        raise ValueError("decode tokens/s needs at least 2 tokens per prompt")
    started: set[int] = set()
    window = {"start": 0.0, "end": 0.0, "tokens": 0}

    def on_event(i: int, event) -> None:
        now = time.perf_counter()
        if len(started) == len(prompts):
            window["tokens"] += len(event.token_ids)
            window["end"] = now
        elif i not in started:
            started.add(i)
            window["start"] = now  # the last prompt's first token: the decode window opens
        # tokens of a started prompt before the last one starts: outside the window

    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0)
    engine.generate(prompts, params, routing=routing, on_event=on_event)
    if window["tokens"] == 0 or window["end"] <= window["start"]:
        raise RuntimeError("no token came after every prompt's first one: nothing to time")
    return window["tokens"] / (window["end"] - window["start"])
