"""A long prompt arriving while a request decodes: the running request's inter-token latency and the
long prompt's time to first token, prefilled in one forward or in chunks (``EngineConfig.prefill_chunk``).

A short request is decoding when a ``--long``-token prompt is submitted; every engine step is timed
until the long request has its first token. One forward stalls the running request for the whole
prefill; chunks bound each step to one chunk's forward plus a decoding step.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/engine_chunked_itl.py --model shape:olmoe-1b-7b@2 --chunks 0,256
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moectl
from bench_args import fail, int_list
from moectl.engine import Engine, EngineConfig, SamplingParams


def run(model, tok, chunk: int, long: int) -> dict:
    """Step times while a ``long``-token prompt is admitted beside a decoding request."""
    config = EngineConfig(max_batch=2, prefill_chunk=chunk or 1_000_000, prefill_tokens=1_000_000)
    engine = Engine(model, tok, config)
    first: dict[str, float] = {}
    with engine:
        engine.submit("The history of the city of", SamplingParams(max_tokens=2000, ignore_eos=True))
        engine.step()
        engine.step()
        sent = time.perf_counter()
        rid = engine.submit([3 + (i % 200) for i in range(long)], SamplingParams(max_tokens=2, ignore_eos=True),
                            on_event=lambda e: first.setdefault(e.request_id, time.perf_counter()))  # fmt: skip
        steps = []
        while rid not in first:
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
    return {"chunk": chunk, "steps": len(steps), "max_step_s": max(steps), "ttft_s": first[rid] - sent}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="shape:olmoe-1b-7b@2")
    ap.add_argument("--long", type=int, default=1024)
    ap.add_argument("--chunks", default="0,256", help="comma list of prefill_chunk sizes; 0: one forward")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    chunks = int_list(args.chunks, "--chunks")
    if args.long < 1 or min(chunks) < 0 or args.threads < 1:
        fail("--long and --threads must be at least 1, --chunks at least 0")
    torch.set_num_threads(args.threads)
    model, tok, _ = moectl.load(args.model, dtype="bfloat16")
    for chunk in chunks:
        r = run(model, tok, chunk, args.long)
        print(
            f"prefill_chunk {chunk or 'none':>5}: {r['steps']} steps, running request's longest gap "
            f"{r['max_step_s']:.2f} s, long prompt's first token after {r['ttft_s']:.2f} s "
            f"(load average {os.getloadavg()[0]:.1f})"
        )


if __name__ == "__main__":
    main()
