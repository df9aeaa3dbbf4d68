"""Decode speed on a busy machine: thread counts and OpenMP wait policies, quiet and beside a busy process.

Each row runs in its own process (OpenMP reads ``OMP_WAIT_POLICY`` once, at start): greedy engine
decoding of ``--model`` (default: OLMoE-1B-7B's width, 2 layers, random bf16) for ``--tokens``
tokens, after a warm-up. "busy" rows start one CPU-bound Python process first (the load a user's
machine has: an editor, a browser tab, a training run) and stop it after. Reported: decode tokens/s,
the ratio to the quiet row of the same setting, and what ``moectl.threads.pick_threads`` chose.

    python benchmarks/threads_busy.py --json benchmarks/results/threads_busy.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from moectl.routing.policy_config import write_json_atomic

_CHILD = r"""
import json, sys, time, torch, moectl
from moectl.engine import Engine, EngineConfig, SamplingParams
from moectl.threads import pick_threads
spec, tokens, threads = sys.argv[1], int(sys.argv[2]), sys.argv[3]
n = pick_threads() if threads == "auto" else int(threads)
torch.set_num_threads(n)
model, tok, info = moectl.load(spec, dtype="bfloat16")
engine = Engine(model, tok, EngineConfig(max_batch=1))
params = SamplingParams(max_tokens=tokens, ignore_eos=True)
engine.generate(["warm up"], SamplingParams(max_tokens=4, ignore_eos=True))
t0 = time.perf_counter()
engine.generate(["The history of the city"], params)
print(json.dumps({"threads": n, "tokens_per_s": tokens / (time.perf_counter() - t0)}))
"""

_BUSY = "import time\nx = 0\nwhile True:\n    x += 1\n"


def run_row(spec: str, tokens: int, threads: str, policy: str, busy: bool) -> dict:
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    if policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    hog = subprocess.Popen([sys.executable, "-c", _BUSY]) if busy else None
    try:
        time.sleep(0.5 if busy else 0)
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, spec, str(tokens), threads],
            env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    row = json.loads(out.stdout.strip().splitlines()[-1])
    return {"threads_asked": threads, "wait_policy": policy, "busy": busy, **row}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="shape:olmoe-1b-7b@2")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args()
    rows = []
    for threads in ("1", "2", "auto"):
        for policy in ("default", "PASSIVE"):
            for busy in (False, True):
                row = run_row(args.model, args.tokens, threads, policy, busy)
                rows.append(row)
                print(
                    f"threads {threads:>4} (ran {row['threads']})  wait {policy:<8} "
                    f"{'busy ' if busy else 'quiet'}  {row['tokens_per_s']:7.2f} tok/s",
                    flush=True,
                )
    quiet = {(r["threads_asked"], r["wait_policy"]): r["tokens_per_s"] for r in rows if not r["busy"]}
    for r in rows:
        r["ratio_to_quiet"] = r["tokens_per_s"] / quiet[(r["threads_asked"], r["wait_policy"])]
    best_quiet = max(quiet.values())
    for r in rows:
        r["ratio_to_best_quiet"] = r["tokens_per_s"] / best_quiet
    if args.json_path:
        result = {"model": args.model, "tokens": args.tokens, "loadavg_after": os.getloadavg(), "rows": rows}
        write_json_atomic(args.json_path, result)


if __name__ == "__main__":
    main()
