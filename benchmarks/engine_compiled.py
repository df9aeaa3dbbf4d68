"""The engine's compiled decoding step against its lean eager forward, same model, one run (#39 item 3).

For each ``--model`` (default: the reference model and OLMoE-1B-7B's dimensions at 4 of its 16
layers, random bf16), two engines on the same weights: ``compile_decode`` off (the lean forward,
``moectl.lm.lean_decode``) and on (``moectl.lm.compiled_decode``). Each decodes ``--tokens``
greedy tokens for 1 row and for ``--rows`` rows (each request routed by ``--routing`` if given: an
expert mask decodes compiled too), alternated ``--repeats`` times (medians). Then a
batch whose rows join and leave (requests of different lengths submitted a step apart) runs
through the compiled engine: the graphs ``torch.compile`` built over the whole run (its own
counter, ``unique_graphs``) say what joining, leaving and the growing cache cost in recompiles.
The warm-up (the compile, at ``Engine.open``) is timed apart. The machine's load is printed beside.

    python benchmarks/engine_compiled.py --threads 1 --json benchmarks/results/engine_compiled.json
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
from moectl.lm import compiled_decode

ROUTING: str | dict | None = None  # every request's routing (``--routing``), registered as "r"


def tok_s(engine: Engine, prompts: list[str], tokens: int) -> float:
    """Decode tokens/s: ``tokens`` greedy tokens per prompt (``decode_timing``)."""
    return decode_tok_s(engine, prompts, tokens, None if ROUTING is None else "r")


def join_and_leave(engine: Engine, rows: int, tokens: int) -> float:
    """Seconds for ``2 * rows`` requests of lengths 2..tokens+1, submitted one per step."""
    start = time.perf_counter()
    for i in range(2 * rows):
        params = SamplingParams(max_tokens=2 + (i * 7) % tokens, ignore_eos=True, temperature=0)
        engine.submit(PROMPTS[i % len(PROMPTS)], params, None, lambda event: None)
        engine.step()
    while engine.stats()["running"] or engine.stats()["waiting"]:
        engine.step()
    return time.perf_counter() - start


def measure(spec: str, args) -> dict:
    from torch._dynamo.utils import counters

    model, tok, _ = moectl.load(spec)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.rows)]
    engines, warmup = {}, {}
    torch._dynamo.reset()
    counters.clear()
    variants = [("lean", False, None), ("compiled", True, None)]
    if args.cpp_wrapper_ab:  # the same step with inductor's Python wrapper: what cpp_wrapper gains
        variants.append(("compiled python-wrapper", True, lambda weights, mode: {}))
    for name, on, options in variants:
        start = time.perf_counter()
        routings = {} if ROUTING is None else {"r": ROUTING}
        config = EngineConfig(max_batch=args.rows, compile_decode=on)
        default = compiled_decode.compile_options
        compiled_decode.compile_options = options or default
        try:
            engines[name] = Engine(model, tok, config, routings=routings).open()
        finally:
            compiled_decode.compile_options = default
        tok_s(engines[name], prompts[:1], 3)
        tok_s(engines[name], prompts, 3)
        warmup[name] = time.perf_counter() - start
    runs: dict[str, list[float]] = {f"{n} {r}": [] for n in engines for r in ("1 row", f"{args.rows} rows")}
    try:
        for _ in range(args.repeats):
            for name, engine in engines.items():
                runs[f"{name} 1 row"].append(tok_s(engine, prompts[:1], args.tokens))
                runs[f"{name} {args.rows} rows"].append(tok_s(engine, prompts, args.tokens))
        churn = join_and_leave(engines["compiled"], args.rows, args.tokens)
        graphs = int(counters["stats"]["unique_graphs"])
        forwards = {name: engine.stats()["decode_forward"] for name, engine in engines.items()}
    finally:
        for engine in engines.values():
            engine.close()
    median = {k: statistics.median(v) for k, v in runs.items()}
    out = {"model": spec, "routing": ROUTING, "warmup_s": warmup, "tok_s": median, "runs": runs, "join_leave_s": churn,
           "graphs_built": graphs, "decode_forward": forwards, "loadavg": os.getloadavg()}  # fmt: skip
    for r in ("1 row", f"{args.rows} rows"):
        out[f"compiled_vs_lean {r}"] = median[f"compiled {r}"] / median[f"lean {r}"]
        if args.cpp_wrapper_ab:
            out[f"cpp_wrapper_gain {r}"] = median[f"compiled {r}"] / median[f"compiled python-wrapper {r}"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", default=None, help="repeatable (default: reference, OLMoE@4)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--routing", default=None, help="every request's routing: a policy file, spec or JSON")
    ap.add_argument("--json", dest="json_path", type=Path, default=None)
    ap.add_argument("--cpp-wrapper-ab", action="store_true",
                    help="also time the compiled step with inductor's Python wrapper (what cpp_wrapper gains)")
    args = ap.parse_args()
    global ROUTING
    ROUTING = json.loads(args.routing) if args.routing and args.routing.lstrip().startswith("{") else args.routing
    if args.tokens < 2 or args.rows < 2 or args.threads < 1 or args.repeats < 1:
        fail("--tokens >= 2, --rows >= 2, --threads >= 1, --repeats >= 1")
    torch.set_num_threads(args.threads)
    specs = args.model or ["models/moectl-small-standard", "shape:olmoe-1b-7b@4"]
    results = []
    for spec in specs:
        r = measure(spec, args)
        results.append(r)
        print(f"{spec}: {args.threads} thread(s), load {r['loadavg'][0]:.1f}, warm-up {r['warmup_s']}")
        for name, value in r["tok_s"].items():
            print(f"  {name:<16} {value:>8.1f} tok/s")
        print(f"  compiled/lean: 1 row {r['compiled_vs_lean 1 row']:.2f}x, {args.rows} rows "
              f"{r[f'compiled_vs_lean {args.rows} rows']:.2f}x; rows joining and leaving: "
              f"{r['graphs_built']} graphs built over the run")  # fmt: skip
        if args.cpp_wrapper_ab:
            print(f"  cpp_wrapper/python wrapper: 1 row {r['cpp_wrapper_gain 1 row']:.2f}x, {args.rows} rows "
                  f"{r[f'cpp_wrapper_gain {args.rows} rows']:.2f}x")  # fmt: skip
    if args.json_path is not None:
        payload = {"threads": args.threads, "tokens": args.tokens, "rows": args.rows, "results": results}
        write_text_atomic(args.json_path, json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json_path}")


if __name__ == "__main__":
    main()
