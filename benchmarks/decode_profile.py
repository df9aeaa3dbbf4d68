"""Where a decode step spends its time: plain transformers ``generate`` vs ``moectl serve-offload``.

Issue 15.5 asks that the routing and residency machinery cost <= 10% of a decode step. This
script measures, it does not optimise: on the same model, prompts (moectl's defaults) and token
count, greedy, batch 1, it runs

- ``transformers``: ``moectl.generate.generate`` on the model as loaded (the experts'
  default implementation) and with ``set_experts_implementation("eager")`` (what offloading runs);
- ``serve-offload``: what ``moectl serve-offload MODEL --budget B`` runs (its defaults: lru, the
  checkpoint's shards as the store), the model loaded once, only ``serve_offload`` timed.

Each is timed without a profiler (tokens/s), then run again under ``cProfile``; printed per run:
own time grouped by where the code lives (moectl, transformers, torch's Python, torch/C++
built-ins, other), and the top functions by own time and by cumulative time (moectl's only).
Profiler overhead inflates Python-heavy paths, so compare groups between runs, and trust the
unprofiled tokens/s for speed.

    python benchmarks/decode_profile.py [--model models/moectl-small-standard] [--budget 1.0]
        [--max-new-tokens 128] [--threads 2] [--top 15] [--json out/decode_profile.json]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from collections import defaultdict
from pathlib import Path

import torch

from moectl.generate import generate, load_prompts
from moectl.models.load import load_model


def _group(file: str, name: str) -> str:
    if "/moectl/" in file:
        return "moectl (python)"
    if "/transformers/" in file:
        return "transformers (python)"
    if "/torch/" in file:
        return "torch (python)"
    if file == "~" and ("torch" in name or "Tensor" in name or "_C." in name):
        return "torch ops (C++ built-ins)"
    return "other"


def breakdown(stats: pstats.Stats, top: int) -> dict:
    """Own time per group; top functions by own time; moectl functions by cumulative time."""
    groups: dict[str, float] = defaultdict(float)
    rows = []
    for (file, line, name), (_, calls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        groups[_group(file, name)] += tottime
        where = f"{Path(file).name}:{line}({name})" if file != "~" else name
        rows.append({"function": where, "file": file, "calls": calls, "own_s": tottime, "cum_s": cumtime})
    total = sum(groups.values())
    by_own = sorted(rows, key=lambda r: -r["own_s"])[:top]
    moectl_cum = sorted((r for r in rows if "/moectl/" in r["file"]), key=lambda r: -r["cum_s"])[:top]
    return {
        "total_own_s": total,
        "groups": {k: {"s": v, "share": v / total} for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
        "top_own": by_own,
        "top_moectl_cumulative": moectl_cum,
    }


def _plain(model, tok, prompts, n: int) -> None:
    generate(model, tok, prompts, n, batch_size=1, progress=False)


def _serve_setup(spec: str, budget: float):
    """What ``moectl serve-offload SPEC --budget B`` builds before generating (its defaults: lru,
    the checkpoint's shards as the store, read on demand): (model, tokenizer, config, reader)."""
    from moectl.models.load_lazy import load_lazy
    from moectl.serve.config import OffloadConfig
    from moectl.serve.policies import parse_policy

    net, tok, reader = load_lazy(spec)
    config = OffloadConfig(budget=budget, store="disk")
    return net, tok, config.with_(policy=parse_policy("lru", net)), reader


def _serve(setup, prompts, n: int, out: dict) -> None:
    from moectl.serve.runner import serve_offload

    net, tok, config, reader = setup
    out.update(serve_offload(net, tok, prompts, config, n, progress=False, reader=reader))


def run(label: str, fn, tokens: int, top: int) -> dict:
    t0 = time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    profiler = cProfile.Profile()
    t1 = time.perf_counter()
    profiler.runcall(fn)
    profiled = time.perf_counter() - t1
    out = {
        "run": label,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "profiled_tokens_per_s": tokens / profiled,
    }
    return out | breakdown(pstats.Stats(profiler), top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/moectl-small-standard")
    parser.add_argument("--budget", default="1.0")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = load_prompts(None)
    n = args.max_new_tokens
    tokens = len(prompts) * n
    model, tok = load_model(args.model)
    _plain(model, tok, prompts[:1], 4)  # warm-up
    results = [
        run("transformers (default experts)", lambda: _plain(model, tok, prompts, n), tokens, args.top)
    ]
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
        results.append(
            run("transformers (eager experts)", lambda: _plain(model, tok, prompts, n), tokens, args.top)
        )
    setup = _serve_setup(args.model, float(args.budget))
    served: dict = {}
    results.append(
        run(
            f"serve-offload --budget {args.budget}",
            lambda: _serve(setup, prompts, n, served),
            tokens,
            args.top,
        )
    )
    results[-1]["serve_reported_tokens_per_s"] = served["tokens_per_s"]
    setup[3].close()
    for r in results:
        print(f"\n== {r['run']}: {r['tokens_per_s']:.1f} tok/s unprofiled ({r['profiled_tokens_per_s']:.1f} profiled)"
              + (f", serve-offload reports {r['serve_reported_tokens_per_s']:.1f}" if "serve_reported_tokens_per_s" in r else ""))  # fmt: skip
        print(f"own time {r['total_own_s']:.2f} s by group:")
        for name, g in r["groups"].items():
            print(f"  {name:>26}: {g['s']:7.2f} s  {100 * g['share']:5.1f}%")
        print("top functions by own time:")
        for f in r["top_own"]:
            print(f"  {f['own_s']:7.3f} s  {f['calls']:>8}  {f['function']}")
        if r["top_moectl_cumulative"]:
            print("moectl functions by cumulative time:")
            for f in r["top_moectl_cumulative"]:
                print(f"  {f['cum_s']:7.3f} s  {f['calls']:>8}  {f['function']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"model": args.model, "threads": args.threads, "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()
