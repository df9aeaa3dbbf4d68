"""What a batch of rows with different routings costs the engine's decoding step (#39 item 2).

Eight requests decode together on ``--model`` (default: the shipped reference model), each with its
own routing — none, two expert masks, forced/omitted experts, ``topk:2``, ``option:8``, Gumbel noise,
a document pool — against the same eight with no routing. Row-constant routings (masks, force/omit,
``topk:N``, the option lens) are prepared once per batch as tensors (``engine/row_constants.py``);
``--per-group`` also times them the way every routing ran before, each group's policies called per
MoE layer, in the same run (alternating, ``--repeats`` times, the median). Tokens per second of
process CPU time (one torch thread: other work on a shared machine distorts it less than wall time)
and of wall time.

    python benchmarks/routing_rows.py --threads 1 --json benchmarks/results/routing_rows.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moectl
from bench_args import fail
from moectl.engine import Engine, EngineConfig, SamplingParams
from moectl.io.atomic import write_text_atomic

MIX = [None, "mask", "mask2", "force", "top2", "opt8", "gumbel", "pool"]
CONSTANT = [None, "mask", "mask2", "force", "top2", "opt8", "mask", "top2"]  # row-constant routings only


def routings(num_experts: int) -> dict[str, str]:
    half = num_experts // 2
    return {
        "mask": json.dumps({"type": "expert_mask", "everywhere": list(range(half))}),
        "mask2": json.dumps({"type": "expert_mask", "everywhere": list(range(half // 2, half // 2 + half))}),
        "force": json.dumps({"type": "experts", "force": {"0": [3]}, "omit": {"1": [0, 1]}}),
        "top2": "topk:2",
        "opt8": "option:8",
        "gumbel": json.dumps({"type": "gumbel", "tau": 0.5}),
        "pool": json.dumps({"type": "document_pool", "d": 8}),
    }


@contextmanager
def per_group():
    """Every routing run per layer and group (row-constant preparation switched off)."""
    from moectl.engine import rows

    kept = rows.row_effects
    rows.row_effects = lambda policies, layers: None
    try:
        yield
    finally:
        rows.row_effects = kept


def tok_s(engine: Engine, routing: list, tokens: int) -> tuple[float, float]:
    """(tokens per CPU second, tokens per wall second) of one batch."""
    prompts = [f"Story {i}: once upon a time there was" for i in range(len(routing))]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0)
    wall, cpu = time.perf_counter(), time.process_time()
    engine.generate(prompts, params, routing=routing)
    n = len(routing) * tokens
    return n / (time.process_time() - cpu), n / (time.perf_counter() - wall)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/moectl-small-standard")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", dest="json_path", type=Path, default=None)
    args = ap.parse_args()
    if args.tokens < 2 or args.repeats < 1 or args.threads < 1:
        fail("--tokens >= 2, --repeats >= 1, --threads >= 1")
    torch.set_num_threads(args.threads)
    model, tok, info = moectl.load(args.model)
    cases = {"none": [None] * 8, "constant": CONSTANT, "mixed": MIX}
    runs: dict[str, list[tuple[float, float]]] = {f"{c} {how}": [] for c in cases for how in ("prepared", "per-group")}
    with Engine(model, tok, EngineConfig(max_batch=8), routings=routings(info.layers[0].num_experts)) as engine:
        tok_s(engine, MIX, 4)  # warm-up
        for _ in range(args.repeats):
            for case, routing in cases.items():
                runs[f"{case} prepared"].append(tok_s(engine, routing, args.tokens))
                with per_group():
                    runs[f"{case} per-group"].append(tok_s(engine, routing, args.tokens))
    cpu = {name: statistics.median(r[0] for r in v) for name, v in runs.items()}
    wall = {name: statistics.median(r[1] for r in v) for name, v in runs.items()}
    base = cpu["none prepared"]
    print(f"{args.model}, 8 rows, {args.tokens} tokens, {args.threads} thread(s), load {os.getloadavg()[0]:.1f}")
    print(f"{'rows routed':<22} {'tok/cpu-s':>9} {'vs none':>8} {'tok/s wall':>10}")
    rows = []
    for name in runs:
        rows.append({"case": name, "tok_per_cpu_s": cpu[name], "tok_s": wall[name], "vs_none": cpu[name] / base,
                     "runs": runs[name]})  # fmt: skip
        print(f"{name:<22} {cpu[name]:>9.1f} {cpu[name] / base:>7.2f}x {wall[name]:>10.1f}")
    if args.json_path is not None:
        result = {"model": args.model, "threads": args.threads, "tokens": args.tokens, "loadavg": os.getloadavg(),
                  "routings": {"constant": CONSTANT, "mixed": MIX}, "rows": rows}  # fmt: skip
        write_text_atomic(args.json_path, json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json_path}")


if __name__ == "__main__":
    main()
