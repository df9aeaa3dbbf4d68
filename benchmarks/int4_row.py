"""One-row int4 decoding through moectl's C loop against PyTorch's int4 kernel, in one run (#40).

``int4_groups.int4_linear`` takes one row through ``moectl.kernels.int4_row`` where it applies;
and ``Int4Weights.grouped`` a decoding step's experts through ``int4_row.grouped``. This decodes
``--tokens`` greedy tokens of one prompt with an int4 ``--model`` (a quantized checkpoint:
``moectl checkpoint quantize``), the loop on and off (``int4_row.applies`` and ``grouped_applies``
forced False: PyTorch's ``_weight_int4pack_mm_for_cpu``, one call per expert), alternated
``--repeats`` times (medians), the load printed beside.

    python benchmarks/int4_row.py --model /work/gguf/olmoe-16/moectl-int4-all-g64 --json benchmarks/results/int4_row.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moectl
from bench_args import PROMPTS, fail
from decode_timing import decode_tok_s
from moectl.engine import Engine, EngineConfig
from moectl.io.atomic import write_text_atomic
from moectl.kernels import int4_row


def tok_s(engine: Engine, tokens: int) -> float:
    """Decode tokens/s of one prompt (``decode_timing``)."""
    return decode_tok_s(engine, PROMPTS[:1], tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="an int4 checkpoint folder")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", dest="json_path", type=Path, default=None)
    args = ap.parse_args()
    if args.tokens < 2 or args.threads < 1 or args.repeats < 1:
        fail("--tokens >= 2, --threads and --repeats >= 1")
    if int4_row._lib() is None:
        fail("moectl's int4 row loop is not built here (it needs an AVX-512 CPU and a C compiler)")
    torch.set_num_threads(args.threads)
    model, tok, _ = moectl.load(args.model)
    real = int4_row.applies, int4_row.grouped_applies
    never = (lambda *a: False, lambda *a: False)
    ways = {"PyTorch's int4 kernel": never, "moectl's int4 row loop": real}
    runs: dict[str, list[float]] = {name: [] for name in ways}
    try:
        with Engine(model, tok, EngineConfig(max_batch=1)) as engine:
            tok_s(engine, 4)  # warm-up
            for _ in range(args.repeats):
                for name, applies in ways.items():
                    int4_row.applies, int4_row.grouped_applies = applies
                    runs[name].append(tok_s(engine, args.tokens))
    finally:
        int4_row.applies, int4_row.grouped_applies = real
    median = {name: statistics.median(v) for name, v in runs.items()}
    gain = median["moectl's int4 row loop"] / median["PyTorch's int4 kernel"]
    load = os.getloadavg()
    for name, value in median.items():
        print(f"{name:<24} {value:7.2f} tok/s  {runs[name]}")
    print(f"gain {gain:.3f}x, {args.threads} threads, load {load[0]:.1f}")
    if args.json_path is not None:
        out = {"model": args.model, "tokens": args.tokens, "threads": args.threads, "loadavg": load,
               "runs": runs, "tok_s": median, "gain": gain}  # fmt: skip
        write_text_atomic(args.json_path, json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json_path}")


if __name__ == "__main__":
    main()
