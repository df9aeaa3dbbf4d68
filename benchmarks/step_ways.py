"""The compiled decoding step two ways, through the engine, in one process (#39).

``--setting attention``: one query's attention compiled as multiply-and-sums over float32 that
inductor fuses into a layer's loops (``decode_step.ATTENTION = "sums"``, shipped) against aten's CPU
flash-attention kernel (``"sdpa"``), whose cost per call (~40 us on this CPU whatever the length) is
sized for many queries.

``--setting guards``: each graph class called, after its first step, without dynamo's guard check
(``CompiledDecode.guards = False``, shipped: dynamo's code for the class run directly, the class
key and a check of the inputs' layouts standing for the guards) against dynamo's guarded call at
every step (``True``).

The engine (``EngineConfig(compile_decode=True)``, greedy, ``--tokens`` tokens) runs both ways,
alternated ``--repeats`` times, at 1 and ``--rows`` rows and each of ``--threads``; both ways'
graphs are built before timing. Medians; the first way is the base; the load printed beside.

    python benchmarks/step_ways.py --setting attention --json benchmarks/results/step_attention.json
    python benchmarks/step_ways.py --setting guards --json benchmarks/results/step_guards.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moectl
from bench_args import PROMPTS, fail, int_list
from decode_timing import decode_tok_s
from moectl.engine import Engine, EngineConfig
from moectl.io.atomic import write_text_atomic
from moectl.lm import decode_step

SETTINGS = {"attention": ("sdpa", "sums"), "guards": ("guarded", "unguarded")}


def tok_s(engine: Engine, prompts: list[str], tokens: int) -> float:
    """Decode tokens/s of ``tokens`` greedy tokens per prompt (``decode_timing``)."""
    return decode_tok_s(engine, prompts, tokens)


def switch(setting: str, engine: Engine) -> Callable[[str], None]:
    """A function that puts ``setting`` to one of its ways."""
    step = engine.runner.compiled
    if setting == "attention":
        return lambda way: setattr(decode_step, "ATTENTION", way)
    if step is None or not hasattr(step, "guards"):
        fail(f"no compiled step ({engine.runner.path})")
    return lambda way: setattr(step, "guards", way == "guarded")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setting", choices=sorted(SETTINGS), required=True)
    ap.add_argument("--model", default="models/moectl-small-standard")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--threads", default="1,2", help="comma list of torch thread counts")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", dest="json_path", type=Path, default=None)
    args = ap.parse_args()
    threads = int_list(args.threads, "--threads")
    if args.tokens < 2 or args.rows < 1 or args.repeats < 1 or min(threads) < 1:
        fail("--tokens must be >= 2 and --rows, --repeats, --threads >= 1")
    ways = SETTINGS[args.setting]
    model, tok, _ = moectl.load(args.model)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.rows)]
    engine = Engine(model, tok, EngineConfig(max_batch=args.rows, compile_decode=True)).open()
    runs: dict[str, list[float]] = {}
    attention = decode_step.ATTENTION
    try:
        put = switch(args.setting, engine)
        for count in threads:
            torch.set_num_threads(count)
            for way in ways:  # both ways' graphs built before any timing
                put(way)
                tok_s(engine, prompts[:1], 4)
                tok_s(engine, prompts, 4)
            for _ in range(args.repeats):
                for way in ways:
                    put(way)
                    for rows in (1, args.rows):
                        runs.setdefault(f"{way} {rows} row(s) {count} thread(s)", []).append(
                            tok_s(engine, prompts[:rows], args.tokens))  # fmt: skip
        path = engine.stats()["decode_forward"]
    finally:
        decode_step.ATTENTION = attention
        engine.close()
    load = os.getloadavg()
    print(f"{args.model}, {args.tokens} tokens, decoding forwards {path}, load {load[0]:.1f}")
    rows = []
    for name, values in runs.items():
        rest = name.split(" ", 1)[1]
        base = statistics.median(runs[f"{ways[0]} {rest}"])
        rows.append({"case": name, "tok_s": statistics.median(values), "vs_base": statistics.median(values) / base,
                     "runs": values})  # fmt: skip
        print(f"{name:<33} {rows[-1]['tok_s']:>8.1f} tok/s  {rows[-1]['vs_base']:>5.2f}x {ways[0]}")
    if args.json_path is not None:
        result = {"setting": args.setting, "ways": ways, "model": args.model, "tokens": args.tokens, "loadavg": load,
                  "decode_forward": path, "rows": rows}  # fmt: skip
        write_text_atomic(args.json_path, json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json_path}")


if __name__ == "__main__":
    main()
