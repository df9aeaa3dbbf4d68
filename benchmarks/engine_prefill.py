"""Prefilling requests admitted together: the admitting step's wall time and the whole run's tokens/s.

``--requests`` prompts are submitted at once to an engine with room for all of them (greedy,
``--tokens`` each, ``ignore_eos``); the first ``engine.step()`` admits them all (prefill and the
first token) and is timed apart from the rest of the run. Run it against two source trees
(``PYTHONPATH=TREE/src``) to compare admission strategies on the same machine. ``--padding both``
alternates engines whose batched prefill's padding skips the experts (``skip``, the default) or
runs through them (``run``), repeat by repeat, and prints the ratio of their admitting steps.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/engine_prefill.py --model shape:olmoe-1b-7b@4 --repeat 2
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/engine_prefill.py --model shape:olmoe-1b-7b@2 --padding both
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moectl
from bench_args import fail
from moectl.engine import Engine, EngineConfig, SamplingParams
from moectl.io.atomic import write_text_atomic
from serve_load import PROMPTS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="shape:olmoe-1b-7b@4")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--padding", choices=["skip", "run", "both"], default="skip")
    ap.add_argument("--json", dest="json_path", type=Path, default=None)
    args = ap.parse_args()
    if args.requests < 1 or args.tokens < 1 or args.repeat < 1 or args.threads < 1:
        fail("--requests, --tokens, --repeat and --threads must be at least 1")
    torch.set_num_threads(args.threads)
    model, tok, _ = moectl.load(args.model, dtype="bfloat16")
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    modes = ["skip", "run"] if args.padding == "both" else [args.padding]
    engines = {
        m: Engine(model, tok, EngineConfig(max_batch=args.requests, skip_padding=m == "skip")) for m in modes
    }
    for engine in engines.values():
        with engine:
            engine.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    rows = []
    for _ in range(args.repeat):
        for mode, engine in engines.items():  # alternating: the machine's load falls on both alike
            with engine:
                rows.append({"padding": mode, **run_once(engine, prompts, params)})
            r = rows[-1]
            print(
                f"{args.requests} requests, padding {mode}: admitting step {r['admit_s']:.3f} s, all "
                f"{r['total_s']:.2f} s, {r['tokens_per_s']:.2f} tok/s (load average {r['load_average']:.1f}; "
                f"{moectl.__file__})"
            )
    if len(modes) == 2:
        admit = {m: sorted(r["admit_s"] for r in rows if r["padding"] == m) for m in modes}
        median = {m: v[len(v) // 2] for m, v in admit.items()}
        print(
            f"admitting step, median: skip {median['skip']:.3f} s, run {median['run']:.3f} s, "
            f"skip/run {median['skip'] / median['run']:.2f}"
        )
    if args.json_path is not None:
        result = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
        write_text_atomic(args.json_path, json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json_path}")


def run_once(engine: Engine, prompts: list[str], params: SamplingParams) -> dict:
    """Submit every prompt, time the admitting step and the whole run."""
    for prompt in prompts:
        engine.submit(prompt, params)
    t0 = time.perf_counter()
    engine.step()  # admits every request: their prefill(s) and first tokens
    t1 = time.perf_counter()
    while engine.stats()["running"]:
        engine.step()
    t2 = time.perf_counter()
    n = len(prompts) * params.max_tokens
    return {
        "admit_s": t1 - t0,
        "total_s": t2 - t0,
        "tokens_per_s": n / (t2 - t0),
        "load_average": os.getloadavg()[0],
    }


if __name__ == "__main__":
    main()
