"""Decode greedily with moectl's engine, the model whole (no offloading): ``llama_decode.py``'s twin.

``offload_capped.py --whole`` runs it under each memory cap beside ``serve-offload``: where a
quantized model fits the cap, serving it whole is moectl's best policy, and this is what it decodes.
Reports what ``llama_decode.py`` reports (decode tokens/s after the first token, time to first
token, peak RSS, bytes read from storage); ``--compile`` decodes through the compiled step.

    python benchmarks/moectl_decode.py --model DIR --tokens 32 --threads 2 --json out.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_decode import _read_bytes, report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", default="The history of the city begins with")
    ap.add_argument(
        "--compile", action="store_true", help="the compiled decoding step (EngineConfig.compile_decode)"
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.tokens < 2 or args.threads < 1:
        print("error: --tokens >= 2 and --threads >= 1", file=sys.stderr)
        return 2
    import torch

    import moectl
    from moectl.engine import Engine, EngineConfig, SamplingParams

    torch.set_num_threads(args.threads)
    io0 = _read_bytes()
    t0 = time.perf_counter()
    model, tokenizer, _ = moectl.load(args.model)
    engine = Engine(
        model, tokenizer, EngineConfig(max_batch=1, compile_decode=args.compile, threads=args.threads)
    )
    engine.open()
    load_s = time.perf_counter() - t0
    times: list[float] = []
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0)
    start = time.perf_counter()
    engine.submit(
        args.prompt, params, None, lambda event: times.extend([time.perf_counter()] * len(event.token_ids))
    )
    while engine.stats()["running"] or engine.stats()["waiting"]:
        engine.step()
    engine.close()
    head = {
        "system": "moectl (whole)",
        "model": args.model,
        "threads": args.threads,
        "compiled": args.compile,
    }
    report(head, times, start, load_s, io0, _read_bytes(), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
