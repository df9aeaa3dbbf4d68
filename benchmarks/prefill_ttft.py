"""Prefill speed through a running OpenAI-compatible server: time to the first token of long prompts.

Sends prompts of random token ids (the same ids to any server: no tokenizer in between) with
``max_tokens: 1``, each prompt new (no prefix a server could reuse), after one warm-up per length;
reports seconds and prompt tokens/s. Point it at ``moectl serve`` (``--prefix-cache 0``) and at
llama.cpp's ``llama-server`` on the GGUF ``moectl export gguf`` writes, one after the other:

    python benchmarks/prefill_ttft.py --url http://127.0.0.1:8000 --model NAME --tokens 512,2048 --repeat 2
"""

from __future__ import annotations

import argparse
import json
import random
import time
import urllib.request


def ttft(url: str, model: str, ids: list[int]) -> tuple[float, dict]:
    body = json.dumps({"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0}).encode()
    request = urllib.request.Request(url.rstrip("/") + "/v1/completions", body, {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=1800) as response:
        reply = json.loads(response.read())
    return time.perf_counter() - start, reply.get("usage") or {}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", default="model", help="the name the server serves (llama-server takes any)")
    parser.add_argument("--tokens", default="512,2048", help="prompt lengths, comma-separated")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--low", type=int, default=300, help="token ids drawn from [low, high)")
    parser.add_argument("--high", type=int, default=40000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    results = []
    for n in (int(t) for t in args.tokens.split(",")):
        seconds = []
        for rep in range(args.repeat + 1):  # the first is a warm-up
            ids = [rng.randrange(args.low, args.high) for _ in range(n)]  # new ids: nothing to reuse
            took, usage = ttft(args.url, args.model, ids)
            if usage.get("prompt_tokens") not in (None, n):
                raise SystemExit(f"the server counted {usage.get('prompt_tokens')} prompt tokens, not {n}")
            if rep:
                seconds.append(took)
            print(f"{n} tokens: {took:.2f} s ({n / took:.1f} tok/s){'' if rep else ' (warm-up)'}", flush=True)
        results.append({"tokens": n, "seconds": seconds, "tokens_per_s": [n / s for s in seconds]})
    out = {"url": args.url, "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
