"""n choices of one prompt: prefilled once (the twins wait a step for its stored KV) or n times.

Times ``Engine.generate([prompt] * n)`` with the prefix cache off (every copy prefilled, together)
and on (one prefill, the twins prefill their last token from it: ``Engine._defer_twins``), in one
run, alternating, on a model built from a public config at full width (``shape:NAME@LAYERS``).

    python benchmarks/engine_twins.py --model shape:olmoe-1b-7b@4 --prompt-tokens 400 --n 4 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import moectl
from moectl.engine import Engine, EngineConfig, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="shape:olmoe-1b-7b@4")
    parser.add_argument("--prompt-tokens", type=int, default=400)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tok, _ = moectl.load(args.model)
    prompt = torch.randint(3, min(tok.vocab_size, 250), (args.prompt_tokens,)).tolist()
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.8, seed=0)
    times: dict[str, list[float]] = {"prefilled n times": [], "prefilled once": []}
    texts = {}
    for _ in range(args.repeat):
        for name, cache in (("prefilled n times", 0), ("prefilled once", 2 * args.prompt_tokens)):
            engine = Engine(model, tok, EngineConfig(max_batch=max(8, args.n), prefix_cache_tokens=cache))
            start = time.perf_counter()
            out = engine.generate([prompt] * args.n, params, seed_per_prompt=True)
            times[name].append(time.perf_counter() - start)
            texts[name] = [c.token_ids for c in out]
    same = texts["prefilled n times"] == texts["prefilled once"]
    result = {
        "model": args.model, "prompt_tokens": args.prompt_tokens, "n": args.n, "max_tokens": args.max_tokens,
        "threads": args.threads, "seconds": times, "same_tokens": same,
        "speedup": statistics.median(times["prefilled n times"]) / statistics.median(times["prefilled once"]),
    }  # fmt: skip
    for name, values in times.items():
        print(f"{name:>18}: {' / '.join(f'{v:.2f}' for v in values)} s")
    print(f"once ÷ n times: {result['speedup']:.2f}× faster; same tokens: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
