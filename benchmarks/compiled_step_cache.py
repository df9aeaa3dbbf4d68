"""The compiled decoding step over caches of growing length, this tree against another revision (#39).

The step's cost should not grow with the cache faster than attention does. Concatenating each new
token's keys and values onto the cache (transformers' ``DynamicLayer.update``) copies the whole
cache at every step; ``moectl.lm.kv_buffers`` writes into buffers with free columns instead. This
times the step alone (``compiled_step_products.time_step``: the compiled graph, no engine) at 1 and
``--rows`` rows over caches of each of ``--caches`` tokens, for this tree and for ``--against``
(a git revision, checked out into a temporary worktree), each in its own process, interleaved for
``--rounds`` rounds (medians over rounds). The machine's load is printed beside; run it quiet.

    python benchmarks/compiled_step_cache.py --against 0938d0c --json benchmarks/results/compiled_step_cache.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import fail, int_list  # noqa: E402


def worker(args: argparse.Namespace) -> None:
    """One process, one tree: ms a step at each rows x cache length (printed as one JSON line)."""
    import torch

    import moectl
    from compiled_step_products import time_step
    from moectl.lm.compiled_decode import CompiledDecode
    from moectl.lm.step_weights import step_weights

    torch.set_num_threads(args.threads)
    model, _, info = moectl.load(args.model)
    weights, why = step_weights(model, info)
    if weights is None:
        fail(f"{args.model}: no compiled step ({why})")
    step = CompiledDecode(weights)
    ms = {}
    with torch.inference_mode():
        for rows in (1, args.rows):
            for cache in int_list(args.caches, "--caches"):
                ms[f"{rows}x{cache}"] = time_step(step, rows, cache, args.steps, 3)
    print(json.dumps(ms))


def run_tree(src: Path, args: argparse.Namespace) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(src))
    cmd = [sys.executable, __file__, "--worker", "--model", args.model, "--rows", str(args.rows),
           "--caches", args.caches, "--threads", str(args.threads), "--steps", str(args.steps)]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        fail(f"the step at {src} failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", required=False, default="HEAD", help="the git revision to compare with")
    ap.add_argument("--model", default=str(ROOT / "models/moectl-small-standard"))
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--caches", default="16,128,512")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", dest="json_path", type=Path, default=None)
    args = ap.parse_args()
    if args.rows < 2 or args.threads < 1 or args.steps < 1 or args.rounds < 1:
        fail("--rows must be >= 2 and --threads, --steps, --rounds >= 1")
    if min(int_list(args.caches, "--caches")) < 1:
        fail("--caches must be positive lengths")
    if args.worker:
        worker(args)
        return
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.against], capture_output=True, text=True)
    if rev.returncode != 0:
        fail(f"--against {args.against!r} is not a git revision of {ROOT}")
    runs: dict[str, list[dict[str, float]]] = {"this tree": [], rev.stdout.strip(): []}
    with tempfile.TemporaryDirectory() as tmp:
        other = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(other), args.against],
                       check=True, capture_output=True)  # fmt: skip
        try:
            for i in range(args.rounds):
                for name, src in (("this tree", ROOT / "src"), (rev.stdout.strip(), other / "src")):
                    runs[name].append(run_tree(src, args))
                    print(f"round {i + 1} {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in runs[name][-1].items()),
                          flush=True)  # fmt: skip
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)], capture_output=True)
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    base = medians[rev.stdout.strip()]
    print(f"\nms a step (median of {args.rounds} rounds, {args.threads} threads); rows x cached tokens")
    print(f"{'':10s} {rev.stdout.strip():>10s} {'this tree':>10s} {'speed-up':>9s}")
    for key, ms in medians["this tree"].items():
        print(f"{key:10s} {base[key]:10.3f} {ms:10.3f} {base[key] / ms:8.2f}x")
    load = os.getloadavg()
    print(f"load {load[0]:.1f}")
    if args.json_path:
        from moectl.io.atomic import write_text_atomic

        out = {"against": args.against, "threads": args.threads, "ms_per_step": medians, "rounds": runs, "loadavg": load}
        write_text_atomic(args.json_path, json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json_path}")


if __name__ == "__main__":
    main()
