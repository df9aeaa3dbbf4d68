"""What a batch costs under a resident-expert budget: the union of its rows' experts against the budget.

A decoding step of B rows needs, per MoE layer, the union of the rows' chosen experts; when that
union exceeds the budget the step must reload experts. For each ``--batch`` size this runs greedy
engine generation of B prompts (``--tokens`` each, prefill included; ``--requests N``: N prompts through a batch of at most B) with the experts offloaded
(``--budget``, ``--policy``, ``--store``), and reports tokens/s, loads and bytes moved per generated
token, the hit rate, and the union per layer of the decoding steps (mean and max) beside the budget.
``--subsets N`` registers N different random expert subsets (``--subset-size`` experts per layer,
fixed seed; routing restricted to them, EMO §4.2) and gives row i the (i mod N)-th: the cost of
serving N different routings at once.

    python benchmarks/engine_union.py --model models/moectl-small-standard --budget 0.25 --batch 1,8
    python benchmarks/engine_union.py --model models/moectl-small-standard --subsets 8 --subset-size 8
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
from bench_args import PROMPTS, fail, int_list
from moectl.engine import Engine, EngineConfig, SamplingParams
from moectl.io.atomic import write_text_atomic
from moectl.offload.offload_config import OffloadConfig


def subsets(info, count: int, size: int, seed: int = 0) -> dict[str, dict]:
    """``count`` random expert-mask specs, ``size`` experts on every MoE layer."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(count):
        experts = {
            str(layer.index): sorted(torch.randperm(layer.num_experts, generator=gen)[:size].tolist())
            for layer in info.layers
        }
        out[f"s{i}"] = {"type": "expert_mask", "experts": experts}
    return out


def run(model, tok, reader, offload: OffloadConfig, args, batch: int, routings: dict[str, dict]) -> dict:
    engine = Engine(
        model, tok, EngineConfig(max_batch=batch, offload=offload), routings=routings, reader=reader
    )
    names = sorted(routings) or [None]
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests or batch)]
    with engine:
        engine.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        before = engine.stats()
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.submit(prompt, params, names[i % len(names)])
        while engine.stats()["running"] or engine.stats()["waiting"]:
            engine.step()
        wall = time.perf_counter() - start
        after = engine.stats()
        budget = max(m.res.budget for m in engine.runtime.modules)
    made = after["generated_tokens"] - before["generated_tokens"]
    off, off0 = after["offload"], before["offload"]
    loads = off["loads"] - off0["loads"]
    hits, misses = off["hits"] - off0["hits"], off["misses"] - off0["misses"]
    return {
        "batch": batch,
        "requests": len(prompts),
        "routings": len(routings),
        "generated_tokens": made,
        "tokens_per_s": made / wall,
        "loads_per_token": loads / made,
        "mb_moved_per_token": (off["bytes_moved"] - off0["bytes_moved"]) / made / 2**20,
        "hit_rate": hits / (hits + misses) if hits + misses else None,
        "union_mean": off.get("union_mean"),  # of every decoding step the engine ran (warm-up included)
        "union_max": off.get("union_max"),
        "budget_per_layer": budget,
        "prefill_forwards": after.get("prefill_forwards", after["prefills"])
        - before.get("prefill_forwards", before["prefills"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/moectl-small-standard")
    ap.add_argument("--budget", type=float, default=0.25, help="resident experts per layer, a fraction")
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--store", default="disk", choices=["disk", "host", "checkpoint"])
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=0, help="requests per run (default: the batch size)")
    ap.add_argument(
        "--subsets", type=int, default=0, help="N different random expert subsets, row i uses i mod N"
    )
    ap.add_argument("--subset-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: moectl.threads)")
    ap.add_argument("--json", dest="json_path", type=Path, default=None)
    args = ap.parse_args()
    batches = int_list(args.batch, "--batch")
    if min(batches) < 1 or args.tokens < 2 or args.subsets < 0 or args.subset_size < 1 or args.requests < 0:
        fail("--batch sizes must be >= 1, --tokens >= 2, --subsets and --requests >= 0, --subset-size >= 1")
    if not 0 < args.budget <= 1:
        fail(f"--budget is a fraction in (0, 1], got {args.budget}")
    from moectl.threads import pick_threads

    threads = pick_threads(args.threads)
    torch.set_num_threads(threads)
    from moectl.offload.loading import load_for_offload

    offload = OffloadConfig(budget=args.budget, policy=args.policy, store=args.store)
    # a checkpoint folder loads lazily (experts read from its shards, never all in memory), as `moectl serve`
    model, tok, reader = load_for_offload(args.model, offload, "bfloat16")
    info = moectl.inspect(model)
    if args.subsets and args.subset_size > min(layer.num_experts for layer in info.layers):
        fail(f"--subset-size {args.subset_size} exceeds the model's experts per layer")
    routings = subsets(info, args.subsets, args.subset_size) if args.subsets else {}
    rows = [run(model, tok, reader, offload, args, b, routings) for b in batches]
    load = os.getloadavg()[0]
    print(f"{args.model}, bf16, {threads} threads, {args.policy} @ {args.budget}, load average {load:.1f}")
    print(
        f"{'batch':>5} {'tok/s':>7} {'loads/tok':>9} {'MB/tok':>7} {'hit':>5} {'union':>6} {'max':>4} {'budget':>6}"
    )
    for r in rows:
        union = "-" if r["union_mean"] is None else f"{r['union_mean']:.1f}"
        top = "-" if r["union_max"] is None else str(r["union_max"])
        hit = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.2f}"
        print(
            f"{r['batch']:>5} {r['tokens_per_s']:>7.2f} {r['loads_per_token']:>9.2f} {r['mb_moved_per_token']:>7.2f} "
            f"{hit:>5} {union:>6} {top:>4} {r['budget_per_layer']:>6}"
        )
    if args.json_path is not None:
        result = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "threads": threads,
            "loadavg": os.getloadavg(),
            "rows": rows,
        }
        write_text_atomic(args.json_path, json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json_path}")


if __name__ == "__main__":
    main()
