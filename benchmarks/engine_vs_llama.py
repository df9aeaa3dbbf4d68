"""moectl's engine against llama.cpp in one process, same model, greedy (#39 item 4).

The engine decodes ``--tokens`` greedy tokens for one prompt (1 row) and for ``--rows`` prompts
together; llama.cpp (llama-cpp-python) decodes the same prompt's token ids from the model's GGUF
export (``moectl export gguf MODEL --outtype bf16``: the same weights at the same bits), one
sequence — its Python API decodes one sequence per context. moectl runs twice: its lean eager
forward and its compiled decoding step (``EngineConfig.compile_decode``; the compile, at the
warm-up, is timed apart). All with ``--threads`` torch / llama.cpp
threads, alternated ``--repeats`` times in this run (medians), the machine's load printed beside.
Decode tokens/s count the tokens after each row's first over the time they took, both systems timed
the same way within one run (``decode_timing``; llama.cpp's from its first token's argmax).

    moectl export gguf models/moectl-small-standard --outtype bf16 --out /tmp/small-bf16.gguf
    python benchmarks/engine_vs_llama.py --gguf /tmp/small-bf16.gguf --json benchmarks/results/engine_vs_llama.json
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
from llama_peer import last_logits, open_llama
from moectl.engine import Engine, EngineConfig
from moectl.engine.engine import encode
from moectl.io.atomic import write_text_atomic


def engine_tok_s(engine: Engine, prompts: list[str], tokens: int) -> float:
    """Decode tokens/s: ``tokens`` greedy tokens per prompt (``decode_timing``)."""
    return decode_tok_s(engine, prompts, tokens)


def llama_tok_s(llm, ids: list[int], tokens: int) -> float:
    """Decode tokens/s timed as ``decode_timing`` times the engine's: after the first token (the
    prompt's logits' argmax), the ``tokens - 1`` steps that make the rest, in one run."""
    llm.reset()
    llm.eval(list(ids))
    token = int(last_logits(llm).argmax())
    start = time.perf_counter()
    for _ in range(tokens - 1):
        llm.eval([token])
        token = int(last_logits(llm).argmax())
    return (tokens - 1) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/moectl-small-standard")
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", dest="json_path", type=Path, default=None)
    args = ap.parse_args()
    if args.tokens < 2 or args.rows < 1 or args.threads < 1 or args.repeats < 1 or not args.gguf.is_file():
        fail("--gguf an existing file, --tokens >= 2, --rows, --threads, --repeats >= 1")
    torch.set_num_threads(args.threads)
    model, tok, _ = moectl.load(args.model)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.rows)]
    llm = open_llama(args.gguf, args.threads)
    ids = encode(tok, prompts[0])
    runs: dict[str, list[float]] = {"llama.cpp 1 row": []}
    engines = {name: Engine(model, tok, EngineConfig(max_batch=args.rows, compile_decode=on)).open()
               for name, on in (("moectl", False), ("moectl compiled", True))}  # fmt: skip
    compile_s = {}
    try:
        for name, engine in engines.items():
            start = time.perf_counter()
            engine_tok_s(engine, prompts[:1], 4)  # warm-up (the compiled engine compiles here)
            engine_tok_s(engine, prompts, 4)
            compile_s[name] = time.perf_counter() - start
            runs[f"{name} 1 row"], runs[f"{name} {args.rows} rows"] = [], []
        llama_tok_s(llm, ids, 4)
        for _ in range(args.repeats):
            runs["llama.cpp 1 row"].append(llama_tok_s(llm, ids, args.tokens))
            for name, engine in engines.items():
                runs[f"{name} 1 row"].append(engine_tok_s(engine, prompts[:1], args.tokens))
                runs[f"{name} {args.rows} rows"].append(engine_tok_s(engine, prompts, args.tokens))
        path = {name: engine.stats()["decode_forward"] for name, engine in engines.items()}
        graphs = engines["moectl compiled"].runner.compiled
        graphs = None if graphs is None else graphs.compiles
    finally:
        for engine in engines.values():
            engine.close()
    median = {name: statistics.median(v) for name, v in runs.items()}
    llama = median["llama.cpp 1 row"]
    load = os.getloadavg()
    print(f"{args.model} vs {args.gguf.name}, {args.threads} threads, {args.tokens} tokens, load {load[0]:.1f}")
    print(f"moectl's decoding forwards: {path}")
    print(f"warm-up (compiling included): {compile_s}; shape classes compiled: {graphs}")
    rows = []
    for name, value in median.items():
        rows.append({"system": name, "tok_s": value, "vs_llama_1_row": value / llama, "runs": runs[name]})
        print(f"{name:<18} {value:>8.1f} tok/s  {value / llama:>5.2f}x llama.cpp's one row")
    if args.json_path is not None:
        result = {"model": args.model, "gguf": str(args.gguf), "threads": args.threads, "tokens": args.tokens,
                  "loadavg": load, "decode_forward": path, "warmup_s": compile_s, "rows": rows}  # fmt: skip
        write_text_atomic(args.json_path, json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json_path}")


if __name__ == "__main__":
    main()
