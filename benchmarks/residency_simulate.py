"""Speed of ``moectl offload simulate`` on a synthetic trace of about a million accesses.

Draws ``--tokens`` × ``--layers`` × ``--top-k`` expert ids (distinct per token and layer) from a
Zipf distribution of exponent ``--skew`` over ``--experts`` experts (0: uniform, as random-weight
checkpoints route), with a different popularity order per layer; then replays it through every
policy at ``--budget`` and prints each policy's hit rate, wall time and accesses per second (one
process, one thread: the replay is sequential Python per layer):

    OMP_NUM_THREADS=1 python benchmarks/residency_simulate.py --json benchmarks/results/residency_simulate.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

from moectl.residency.simulate import DEFAULT_POLICIES, SimConfig, run
from moectl.residency.trace_input import Accesses, check_ids


def synthetic(tokens: int, layers: int, k: int, experts: int, skew: float, seed: int) -> np.ndarray:
    """[tokens, layers, k] distinct ids per (token, layer): top-k of log p + Gumbel noise, i.e. draws
    without replacement from p ∝ rank^-skew (vectorised)."""
    rng = np.random.default_rng(seed)
    logp = -skew * np.log(np.arange(1, experts + 1))
    perm = np.argsort(rng.random((layers, experts)), axis=1)  # each layer's popularity order
    scores = logp[perm][None] + rng.gumbel(size=(tokens, layers, experts))
    return np.argpartition(-scores, k - 1, axis=-1)[..., :k].astype(np.int64)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=7813)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--skew", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    chosen = synthetic(args.tokens, args.layers, args.top_k, args.experts, args.skew, args.seed)
    check_ids(chosen, args.experts)
    draw_s = time.perf_counter() - start
    acc = Accesses(chosen, args.experts, ("synthetic",))
    rows = run(SimConfig(acc, (args.budget,), tuple(args.policies.split(","))))
    print(
        f"{acc.accesses:,} accesses ({args.tokens} tokens × {args.layers} layers × top-{args.top_k} of "
        f"{args.experts}, Zipf skew {args.skew}), budget {args.budget}; drawn in {draw_s:.2f} s"
    )
    print(f"{'policy':<13}{'hit rate':>10}{'seconds':>10}{'accesses/s':>14}")
    for r in rows:
        r["accesses_per_s"] = acc.accesses / r["seconds"]
        print(f"{r['policy']:<13}{r['hit_rate']:>10.4f}{r['seconds']:>10.2f}{r['accesses_per_s']:>14,.0f}")
    doc = {
        **{k: v for k, v in vars(args).items() if k != "json"},
        "accesses": acc.accesses,
        "routing": f"synthetic Zipf(skew={args.skew})",
        "machine": platform.processor() or platform.machine(),
        "draw_s": draw_s,
        "results": [{k: v for k, v in r.items() if k != "hit_rate_per_layer"} for r in rows],
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return doc


if __name__ == "__main__":
    main()
