"""The compiled decoding step's attention: aten's kernel against sums the compiler fuses (#39).

``moectl.lm.decode_step._attend`` writes one query's attention, compiled, as multiply-and-sums over
float32 that inductor fuses into a layer's loops (``decode_step.ATTENTION = "sums"``, shipped);
``"sdpa"`` calls aten's CPU flash-attention kernel, whose cost per call (~40 us on this CPU whatever
the length) is sized for many queries. This runs the engine (``EngineConfig(compile_decode=True)``,
greedy, ``--tokens`` tokens) both ways in one process, alternated ``--repeats`` times, at 1 and
``--rows`` rows and each of ``--threads``; both graphs are built before timing (dynamo guards on
the setting, so each way keeps its own graph). Medians, the machine's load printed beside.

    python benchmarks/step_attention.py --json benchmarks/results/step_attention.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moectl
from bench_args import PROMPTS, fail, int_list
from moectl.engine import Engine, EngineConfig, SamplingParams
from moectl.io.atomic import write_text_atomic
from moectl.lm import decode_step

WAYS = ("sdpa", "sums")


def tok_s(engine: Engine, prompts: list[str], tokens: int) -> float:
    """Decode tokens/s of ``tokens`` greedy tokens per prompt, less a one-token run (the prefill)."""
    one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
    start = time.perf_counter()
    engine.generate(prompts, one)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0))
    return len(prompts) * (tokens - 1) / (time.perf_counter() - start - prefill)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    model, tok, _ = moectl.load(args.model)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.rows)]
    engine = Engine(model, tok, EngineConfig(max_batch=args.rows, compile_decode=True)).open()
    runs: dict[str, list[float]] = {}
    before = decode_step.ATTENTION
    try:
        for count in threads:
            torch.set_num_threads(count)
            for way in WAYS:  # both ways' graphs built before any timing
                decode_step.ATTENTION = way
                tok_s(engine, prompts[:1], 4)
                tok_s(engine, prompts, 4)
            for _ in range(args.repeats):
                for way in WAYS:
                    decode_step.ATTENTION = way
                    for rows in (1, args.rows):
                        runs.setdefault(f"{way} {rows} row(s) {count} thread(s)", []).append(
                            tok_s(engine, prompts[:rows], args.tokens))  # fmt: skip
        path = engine.stats()["decode_forward"]
    finally:
        decode_step.ATTENTION = before
        engine.close()
    load = os.getloadavg()
    print(f"{args.model}, {args.tokens} tokens, decoding forwards {path}, load {load[0]:.1f}")
    rows = []
    for name, values in runs.items():
        way, rest = name.split(" ", 1)
        base = statistics.median(runs[f"sdpa {rest}"])
        rows.append({"case": name, "tok_s": statistics.median(values), "vs_sdpa": statistics.median(values) / base,
                     "runs": values})  # fmt: skip
        print(f"{name:<28} {rows[-1]['tok_s']:>8.1f} tok/s  {rows[-1]['vs_sdpa']:>5.2f}x sdpa")
    if args.json_path is not None:
        result = {"model": args.model, "tokens": args.tokens, "loadavg": load, "decode_forward": path, "rows": rows}
        write_text_atomic(args.json_path, json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json_path}")


if __name__ == "__main__":
    main()
