"""Prefill of a quantized model with and without moectl's C dequantisation for many rows, in one process.

int4 (``moectl.quant.int4_groups.int4_linear``) and int8 (``moectl.offload.int8.int8_linear``)
products of 24 (int4) or 16 (int8) bf16 rows or more (``INT4_UNPACK_MIN_ROWS``, ``UNPACK_MIN_ROWS``) take the weight
dequantised by ``moectl.kernels.unpack`` and PyTorch's bf16 product; below,
or with the thresholds set past every prompt (``off``), the quantized kernels, whose time grows with
the rows (int8 past a few dozen rows: the weight dequantised by tensor code). One
forward of ``--tokens`` random token ids per length, the two ways alternated ``--repeats`` times
(medians), ``logits_to_keep=1`` as a prefill; the machine's load printed beside.

    python benchmarks/quant_prefill.py --model /work/gguf/olmoe-16/moectl-int4-all-g64 --tokens 20,128,512 \\
        --json benchmarks/results/int4_prefill.json
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
from bench_args import fail, int_list
from moectl.io.atomic import write_text_atomic
from moectl.offload import int8 as int8_weights
from moectl.quant import int4_groups


def prefill_ms(model, ids: torch.Tensor) -> float:
    with torch.inference_mode():
        start = time.perf_counter()
        model(input_ids=ids, logits_to_keep=1)
        return (time.perf_counter() - start) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="an int4 or int8 checkpoint (moectl checkpoint quantize)")
    ap.add_argument("--tokens", default="20,128,512")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", dest="json_path", type=Path, default=None)
    args = ap.parse_args()
    lengths = int_list(args.tokens, "--tokens")
    if min(lengths) < 1 or args.repeats < 1 or args.threads < 1:
        fail("--tokens, --repeats and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    model, _, _ = moectl.load(str(args.model), dtype="bfloat16")
    default = (int4_groups.INT4_UNPACK_MIN_ROWS, int8_weights.UNPACK_MIN_ROWS)
    ways = {"unpack": default, "off": (1 << 30, 1 << 30)}
    load_before = os.getloadavg()
    rows = []
    for t in lengths:
        ids = torch.randint(100, 5000, (1, t), generator=torch.Generator().manual_seed(t))
        prefill_ms(model, ids)  # warm
        times: dict[str, list[float]] = {w: [] for w in ways}
        for _ in range(args.repeats):
            for way, threshold in ways.items():
                int4_groups.INT4_UNPACK_MIN_ROWS, int8_weights.UNPACK_MIN_ROWS = threshold
                times[way].append(prefill_ms(model, ids))
        int4_groups.INT4_UNPACK_MIN_ROWS, int8_weights.UNPACK_MIN_ROWS = default
        med = {w: statistics.median(v) for w, v in times.items()}
        rows.append({"tokens": t, "ms": med, "speedup": med["off"] / med["unpack"], "all_ms": times})
        print(f"{t:5d} tokens: the quantized kernels {med['off']:8.1f} ms, C dequantisation from {default[0]} / {default[1]} rows (int4 / int8) "
              f"{med['unpack']:8.1f} ms ({med['off'] / med['unpack']:.2f}x)", flush=True)  # fmt: skip
    load_after = os.getloadavg()
    print(f"load {load_before[0]:.1f} -> {load_after[0]:.1f}")
    if args.json_path:
        out = {"model": str(args.model), "threads": args.threads, "unpack_min_rows": {"int4": default[0], "int8": default[1]},
               "load_before": load_before, "load_after": load_after, "rows": rows}  # fmt: skip
        write_text_atomic(args.json_path, json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json_path}")


if __name__ == "__main__":
    main()
