"""The compiled decoding step alone, its small weights' products as BLAS calls or as fused sums (#39).

``moectl.lm.decode_step._linear`` writes a small weight's product, compiled, as a multiply-and-sum
that inductor fuses into the layer's loops instead of calling the BLAS product (15-25 us a call at
a few rows, whatever the size). This times the step alone (``CompiledDecode``'s graph on a cache of
``--cache`` tokens, no engine around it) both ways, ``SMALL_PRODUCTS`` = "product" and "sum" (the
shipped way), for 1 and ``--rows`` rows at each of ``--threads``; each variant is
compiled afresh (``torch._dynamo.reset``), timed ``--repeats`` x ``--steps`` steps (medians of the
repeats). The machine's load is printed beside; run it quiet.

    python benchmarks/compiled_step_products.py --json benchmarks/results/compiled_step_products.json
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
from bench_args import fail
from moectl.io.atomic import write_text_atomic
from moectl.lm import decode_step
from moectl.lm.compiled_decode import CompiledDecode
from moectl.lm.step_weights import step_weights


def time_step(step: CompiledDecode, rows: int, cache: int, steps: int, repeats: int) -> float:
    """Median ms per step of ``rows`` rows over a cache of ``cache`` tokens (the step's own graph)."""
    from transformers import DynamicCache

    w = step.weights
    kv = DynamicCache()
    for i in range(len(w.layers)):
        t = torch.randn(rows, w.num_kv_heads, cache, w.head_dim, dtype=w.dtype)
        kv.update(t, t.clone(), i)
    last = torch.zeros(rows, dtype=torch.long)
    valid = torch.ones(rows, cache + 1, dtype=torch.bool)
    positions = torch.full((rows, 1), cache)
    keys = [layer.keys for layer in kv.layers]
    values = [layer.values for layer in kv.layers]
    step(last, valid, positions, kv)  # the graph for this class, built
    for layer, k, v in zip(kv.layers, keys, values, strict=True):
        layer.keys, layer.values = k, v  # the same cache length every call
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            step(last, valid, positions, kv)
            for layer, k, v in zip(kv.layers, keys, values, strict=True):
                layer.keys, layer.values = k, v
        times.append((time.perf_counter() - start) / steps * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/moectl-small-standard")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--cache", type=int, default=64)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", dest="json_path", type=Path, default=None)
    args = ap.parse_args()
    if args.rows < 2 or args.cache < 1 or args.steps < 1 or args.repeats < 1 or min(args.threads) < 1:
        fail("--rows must be >= 2 and --cache, --steps, --repeats, --threads >= 1")
    model, _, info = moectl.load(args.model)
    weights, why = step_weights(model, info)
    if weights is None:
        fail(f"{args.model}: no compiled step ({why})")
    ms: dict[str, float] = {}
    with torch.inference_mode():
        for threads in args.threads:
            torch.set_num_threads(threads)
            for way in ("product", "sum"):
                decode_step.SMALL_PRODUCTS = way
                torch._dynamo.reset()
                step = CompiledDecode(weights)
                for rows in (1, args.rows):
                    key = f"{threads} threads {rows} rows {way}"
                    ms[key] = time_step(step, rows, args.cache, args.steps, args.repeats)
                    print(f"{key:32s} {ms[key]:7.3f} ms a step", flush=True)
    decode_step.SMALL_PRODUCTS = "sum"
    out = {"model": args.model, "cache": args.cache, "ms_per_step": ms, "loadavg": os.getloadavg()}
    print(f"load {out['loadavg'][0]:.1f}")
    if args.json_path:
        write_text_atomic(args.json_path, json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json_path}")


if __name__ == "__main__":
    main()
