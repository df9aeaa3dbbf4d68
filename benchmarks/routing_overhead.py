"""Forward-time overhead of moectl routing over a vanilla forward (issue: routing core).

Tiny OLMoE and Qwen3-MoE, batch 4 x 256 tokens, CPU. Prints, per model, the ratio of the median
forward time under each configuration to the vanilla forward, all measured in this one run with
the configurations interleaved so that drift in machine load hits all of them alike.

Targets: no-op policy <= 1.05, mask <= 1.10, mask + trace recording <= 1.20.

Ratios are of the minimum over repeats (the run least disturbed by other work) of process CPU time (``time.process_time``) with one torch thread, so that other work
on a shared machine does not distort them; wall-clock ratios are printed beside them.

    python benchmarks/routing_overhead.py [--repeats 15] [--json out/routing_overhead.json]
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import nullcontext
from pathlib import Path

import torch

import moectl
from moectl.routing import ExpertMask, GumbelTopK, route

TARGETS = {"no-op policy": 1.05, "mask": 1.10, "mask + trace": 1.20}


def _configs(model, info):
    # every expert allowed: the selection is recomputed under the mask, the experts' compute is unchanged
    mask = ExpertMask.everywhere(info, range(info.num_experts))
    return {
        "vanilla": lambda: nullcontext(),
        "no-op policy": lambda: route(model, GumbelTopK(0.0), info=info),
        "mask": lambda: route(model, mask, info=info),
        "mask + trace": lambda: route(model, mask, record=True, info=info),
    }


@torch.no_grad()
def measure(family: str, batch: int, length: int, repeats: int) -> dict:
    model = moectl.tiny(family)
    info = moectl.inspect(model)
    ids = torch.randint(3, 256, (batch, length), generator=torch.Generator().manual_seed(0))
    configs = _configs(model, info)
    times: dict[str, list[float]] = {name: [] for name in configs}
    walls: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(2):  # warm-up
        for make in configs.values():
            with make():
                model(ids)
    for _ in range(repeats):
        for name, make in configs.items():
            with make():
                start, wall = time.process_time(), time.perf_counter()
                model(ids)
                times[name].append(time.process_time() - start)
                walls[name].append(time.perf_counter() - wall)
    base = min(times["vanilla"])
    base_wall = min(walls["vanilla"])
    return {
        "family": family,
        "vanilla_ms": base * 1e3,
        "ratios": {name: min(t) / base for name, t in times.items() if name != "vanilla"},
        "wall_ratios": {
            name: min(t) / base_wall for name, t in walls.items() if name != "vanilla"
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = [measure(f, args.batch, args.length, args.repeats) for f in ("olmoe", "qwen3_moe")]
    print(
        f"forward CPU-time ratio to vanilla, batch {args.batch} x {args.length} tokens, minimum of {args.repeats} (the least-disturbed run)"
    )
    print(
        f"{'model':<12}{'vanilla ms':>12}"
        + "".join(f"{name:>16}" for name in TARGETS)
        + "   (wall-clock ratios)"
    )
    for r in results:
        cells = "".join(
            f"{r['ratios'][n]:>12.3f} {'ok' if r['ratios'][n] <= t else 'OVER':>3}"
            for n, t in TARGETS.items()
        )
        wall = " ".join(f"{r['wall_ratios'][n]:.3f}" for n in TARGETS)
        print(f"{r['family']:<12}{r['vanilla_ms']:>12.1f}{cells}   ({wall})")
    print("targets: " + ", ".join(f"{n} <= {t}" for n, t in TARGETS.items()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"targets": TARGETS, "results": results}, indent=2))


if __name__ == "__main__":
    main()
