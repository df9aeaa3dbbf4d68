"""What the expert distribution record costs a decode step (``engine/expert_counts.py``, #41).

Greedy engine decoding of ``--model`` at each ``--batch`` size with the record off and on, in one
run, alternating ``--repeats`` times (the median of each): tokens/s and the ratio on/off.

    python benchmarks/expert_counts_cost.py --model models/moectl-small-standard --json out.json
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


def tokens_per_s(engine: Engine, batch: int, tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    start = time.perf_counter()
    engine.generate(prompts, params)
    return batch * tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/moectl-small-standard")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", dest="json_path", type=Path, default=None)
    args = ap.parse_args()
    batches = int_list(args.batch, "--batch")
    if min(batches) < 1 or args.tokens < 2 or args.repeats < 1:
        fail("--batch sizes >= 1, --tokens >= 2 and --repeats >= 1")
    from moectl.threads import pick_threads

    threads = pick_threads(args.threads)
    torch.set_num_threads(threads)
    model, tok, _ = moectl.load(args.model, dtype="bfloat16")
    rows = []
    with Engine(model, tok, EngineConfig(max_batch=max(batches))) as engine:
        tokens_per_s(engine, 1, 4)  # warm-up
        for batch in batches:
            runs: dict[str, list[float]] = {"off": [], "on": []}
            for _ in range(args.repeats):
                for mode in ("off", "on"):
                    engine.expert_counts.start() if mode == "on" else engine.expert_counts.stop()
                    runs[mode].append(tokens_per_s(engine, batch, args.tokens))
            engine.expert_counts.stop()
            off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
            rows.append({"batch": batch, "off_tok_s": off, "on_tok_s": on, "on_vs_off": on / off, "runs": runs})
    print(f"{args.model}, bf16, {threads} threads, load average {os.getloadavg()[0]:.1f}")
    print(f"{'batch':>5} {'off tok/s':>10} {'on tok/s':>10} {'on/off':>7}")
    for r in rows:
        print(f"{r['batch']:>5} {r['off_tok_s']:>10.1f} {r['on_tok_s']:>10.1f} {r['on_vs_off']:>7.3f}")
    if args.json_path is not None:
        result = {"model": args.model, "threads": threads, "tokens": args.tokens, "loadavg": os.getloadavg(),
                  "rows": rows}  # fmt: skip
        write_text_atomic(args.json_path, json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json_path}")


if __name__ == "__main__":
    main()
