"""Which bf16 products take moectl's C kernel on a CPU with native bf16 (AMX / AVX512-BF16), A/B in one run.

``moectl.kernels.bf16_rows.few``: on such CPUs the kernel takes up to ``NATIVE_FEW_ROWS`` rows
(``NATIVE_SMALL_ROWS`` for small weights) and PyTorch's bf16 product the rest; before, the kernel
took up to ``FEW_ROWS`` (48) there too. Both rules in one process, alternated ``--repeats`` times
(medians), on the same engine: decoding ``--rows`` rows (tokens/s, greedy) and prefilling them
together (ms for a one-token generation of all the prompts), per ``--model`` (default: the reference
model and OLMoE-1B-7B's dimensions at 4 of its 16 layers, random bf16). The load is printed beside.

    python benchmarks/native_rows.py --threads 2 --json benchmarks/results/native_rows.json
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
from bench_args import PROMPTS, fail
from decode_timing import decode_tok_s
from moectl.engine import Engine, EngineConfig, SamplingParams
from moectl.io.atomic import write_text_atomic
from moectl.kernels import bf16_rows

RULES = {"kernel to 48 rows (before)": (bf16_rows.FEW_ROWS, bf16_rows.FEW_ROWS),
         "few rows (now)": (bf16_rows.NATIVE_FEW_ROWS, bf16_rows.NATIVE_SMALL_ROWS)}  # fmt: skip


def measure(engine: Engine, prompts: list[str], tokens: int) -> tuple[float, float]:
    """(prefill ms of all the prompts together, decode tokens/s after it)."""
    start = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True, temperature=0))
    prefill = time.perf_counter() - start
    return prefill * 1e3, decode_tok_s(engine, prompts, tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", help="repeatable (default: the reference model and OLMoE@4)")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="the compiled decoding step (default: lean)")
    ap.add_argument("--json", dest="json_path", type=Path, default=None)
    args = ap.parse_args()
    if args.rows < 1 or args.tokens < 2 or args.threads < 1 or args.repeats < 1:
        fail("--rows, --threads, --repeats >= 1 and --tokens >= 2")
    if not (bf16_rows.native_bf16() and bf16_rows.available()):
        fail("this CPU has no native bf16 products (or the kernel is not built): nothing to compare")
    torch.set_num_threads(args.threads)
    prompts = [PROMPTS[i % len(PROMPTS)] * 3 for i in range(args.rows)]
    results = {}
    for spec in args.model or ["models/moectl-small-standard", "shape:olmoe-1b-7b@4"]:
        model, tok, _ = moectl.load(spec)
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in RULES}
        with Engine(model, tok, EngineConfig(max_batch=args.rows, compile_decode=args.compile)) as engine:
            measure(engine, prompts, 4)  # warm-up (and the compile)
            for _ in range(args.repeats):
                for name, (few, small) in RULES.items():
                    bf16_rows.NATIVE_FEW_ROWS, bf16_rows.NATIVE_SMALL_ROWS = few, small
                    runs[name].append(measure(engine, prompts, args.tokens))
        bf16_rows.NATIVE_FEW_ROWS, bf16_rows.NATIVE_SMALL_ROWS = RULES["few rows (now)"]
        median = {name: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for name, v in runs.items()}
        before, now = median["kernel to 48 rows (before)"], median["few rows (now)"]
        results[spec] = {"runs": runs, "prefill_ms": {k: v[0] for k, v in median.items()},
                         "decode_tok_s": {k: v[1] for k, v in median.items()},
                         "prefill_gain": before[0] / now[0], "decode_gain": now[1] / before[1]}  # fmt: skip
        print(f"{spec}: {args.rows} rows prefill {before[0]:.1f} -> {now[0]:.1f} ms ({before[0] / now[0]:.2f}x), "
              f"decode {before[1]:.1f} -> {now[1]:.1f} tok/s ({now[1] / before[1]:.2f}x)", flush=True)  # fmt: skip
        del model
    load = os.getloadavg()
    print(f"{args.threads} threads, load {load[0]:.1f}")
    if args.json_path is not None:
        out = {"rows": args.rows, "tokens": args.tokens, "threads": args.threads, "compile": args.compile,
               "loadavg": load, "models": results}  # fmt: skip
        write_text_atomic(args.json_path, json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json_path}")


if __name__ == "__main__":
    main()
