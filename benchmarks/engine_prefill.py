"""Prefilling requests admitted together: the admitting step's wall time and the whole run's tokens/s.

``--requests`` prompts are submitted at once to an engine with room for all of them (greedy,
``--tokens`` each, ``ignore_eos``); the first ``engine.step()`` admits them all (prefill and the
first token) and is timed apart from the rest of the run. Run it against two source trees
(``PYTHONPATH=TREE/src``) to compare admission strategies on the same machine.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/engine_prefill.py --model shape:olmoe-1b-7b@4 --repeat 2
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
    ap.add_argument("--json", dest="json_path", type=Path, default=None)
    args = ap.parse_args()
    if args.requests < 1 or args.tokens < 1 or args.repeat < 1 or args.threads < 1:
        fail("--requests, --tokens, --repeat and --threads must be at least 1")
    torch.set_num_threads(args.threads)
    model, tok, _ = moectl.load(args.model, dtype="bfloat16")
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    engine = Engine(model, tok, EngineConfig(max_batch=args.requests))
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    rows = []
    with engine:
        engine.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        for _ in range(args.repeat):
            for prompt in prompts:
                engine.submit(prompt, params)
            t0 = time.perf_counter()
            engine.step()  # admits every request: their prefill(s) and first tokens
            t1 = time.perf_counter()
            while engine.stats()["running"]:
                engine.step()
            t2 = time.perf_counter()
            rows.append(
                {
                    "admit_s": t1 - t0,
                    "total_s": t2 - t0,
                    "tokens_per_s": args.requests * args.tokens / (t2 - t0),
                    "load_average": os.getloadavg()[0],
                }
            )
            r = rows[-1]
            print(
                f"{args.requests} requests: admitting step {r['admit_s']:.2f} s, all {r['total_s']:.2f} s, "
                f"{r['tokens_per_s']:.2f} tok/s (load average {r['load_average']:.1f}; {moectl.__file__})"
            )
    if args.json_path is not None:
        result = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
        write_text_atomic(args.json_path, json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json_path}")


if __name__ == "__main__":
    main()
