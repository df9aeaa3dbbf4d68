"""The compiled decoding step alone, its small weights' products as BLAS calls or as fused sums (#39).

``moectl.lm.decode_step._linear`` writes a small weight's product, compiled, as a multiply-and-sum
that inductor fuses into the layer's loops instead of calling the BLAS product (15-25 us a call at
a few rows, whatever the size). This times the step alone (``CompiledDecode``'s graph on a cache of
``--cache`` tokens, no engine around it) both ways, BLAS products everywhere and sums everywhere
(the shipped rule, ``decode_step.sums_for``, takes sums but at several rows on one thread), for 1
and ``--rows`` rows at each of ``--threads``; each variant is
compiled afresh (``torch._dynamo.reset``), timed ``--repeats`` x ``--steps`` steps (medians of the
repeats). ``--split`` then splits one row's step by torch.profiler with inductor's kernel profile
(the layers' generated kernels, the LM head, attention, top-k, dynamo's guards, the rest) and says
how many weight bytes it reads. The machine's load is printed beside; run it quiet.

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
from moectl.lm import compiled_decode, decode_step
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
    step(last, torch.ones(rows, cache + 1, dtype=torch.bool), torch.full((rows, 1), cache), kv)  # graph built
    valid = torch.ones(rows, cache + 2, dtype=torch.bool)  # the cache is a column longer now
    positions = torch.full((rows, 1), cache + 1)
    saved = [dict(vars(layer)) for layer in kv.layers]  # the cache after one step: every call from here
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            step(last, valid, positions, kv)
            for layer, state in zip(kv.layers, saved, strict=True):
                vars(layer).update(state)  # back to the same length (and buffers: ``lm/kv_buffers``)
        times.append((time.perf_counter() - start) / steps * 1e3)
    return statistics.median(times)


SPLIT = (  # profiler events -> part of the step
    ("layers' generated kernels", lambda k: k.startswith("graph_") and "cpp_fused" in k),
    ("LM head (moectl::linear)", lambda k: k == "moectl::linear"),
    ("attention (aten SDPA)", lambda k: k.startswith("aten::_scaled_dot_product")),
    ("top-k (aten)", lambda k: k == "aten::topk"),
    ("dynamo's guards", lambda k: k == "TorchDynamo Cache Lookup"),
)


def active_bytes(w) -> int:
    """Weight bytes one row's step reads: every layer's attention, router and shared or dense MLP,
    top-k experts' weights, the final norm and the LM head (one embedding row: left out)."""
    def nbytes(*ts) -> int:
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    total = nbytes(w.lm_head, w.lm_head_bias)
    for layer in w.layers:
        total += nbytes(layer.q, layer.k, layer.v, layer.o, layer.q_bias, layer.k_bias, layer.v_bias, layer.o_bias)
        total += nbytes(layer.router, layer.shared_gate, *(layer.shared or ()), *(layer.dense or ()))
        if layer.gate_up is not None:
            total += w.top_k * nbytes(layer.gate_up[0], layer.down[0])
    return total


def split(step: CompiledDecode, rows: int, cache: int, steps: int) -> dict:
    """Where a step's time goes, from torch.profiler with inductor's kernel profile (the graph must
    be built with ``cpp.enable_kernel_profile`` and the Python wrapper: the C++ one hides its kernels)."""
    from torch.profiler import ProfilerActivity, profile

    time_step(step, rows, cache, 3, 1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = time_step(step, rows, cache, steps, 1)
    events = {e.key: e.self_cpu_time_total / steps / 1e3 for e in prof.key_averages()}  # ms a step
    parts = {name: sum(v for k, v in events.items() if match(k)) for name, match in SPLIT}
    parts["everything else (wrapper, allocation, small ops)"] = max(0.0, wall - sum(parts.values()))
    return {"ms_per_step_profiled": wall, "parts_ms": parts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/moectl-small-standard")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--cache", type=int, default=64)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--split", action="store_true",
                    help="also split one row's step by torch.profiler (inductor's kernel profile, Python wrapper)")
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
                compiled_decode.sums_for = lambda rows, threads, way=way: way == "sum"  # everywhere, this way
                torch._dynamo.reset()
                step = CompiledDecode(weights)
                for rows in (1, args.rows):
                    key = f"{threads} threads {rows} rows {way}"
                    ms[key] = time_step(step, rows, args.cache, args.steps, args.repeats)
                    print(f"{key:32s} {ms[key]:7.3f} ms a step", flush=True)
    compiled_decode.sums_for = decode_step.sums_for
    out = {"model": args.model, "cache": args.cache, "ms_per_step": ms, "loadavg": os.getloadavg()}
    if args.split:
        import torch._inductor.config as inductor_config

        torch.set_num_threads(max(args.threads))
        torch._dynamo.reset()
        default = compiled_decode.compile_options
        compiled_decode.compile_options = lambda weights, mode: {}  # the Python wrapper shows the kernels
        try:
            with inductor_config.patch({"cpp.enable_kernel_profile": True}), torch.inference_mode():
                out["split_1_row"] = split(CompiledDecode(weights), 1, args.cache, args.steps)
        finally:
            compiled_decode.compile_options = default
        wall = out["split_1_row"]["ms_per_step_profiled"]
        print(f"one row, {max(args.threads)} threads, profiled: {wall:.3f} ms a step (Python wrapper, profiler on)")
        for name, value in out["split_1_row"]["parts_ms"].items():
            print(f"  {name:48s} {value:6.3f} ms  {100 * value / wall:5.1f}%")
        weight_bytes = active_bytes(weights)
        out["split_1_row"]["active_weight_bytes"] = weight_bytes
        print(f"  weights one row's step reads: {weight_bytes / 2**20:.1f} MiB")
    print(f"load {out['loadavg'][0]:.1f}")
    if args.json_path:
        write_text_atomic(args.json_path, json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json_path}")


if __name__ == "__main__":
    main()
