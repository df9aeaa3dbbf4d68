"""lm-eval's loglikelihood requests through ``moectl serve`` against the same requests in process.

lm-eval's ``local-completions`` model (token-id prompts, ``echo``, ``logprobs: 1``, ``max_tokens: 1``,
``--batch`` prompts per request, ``--concurrent`` requests at once) scores ``--pairs`` (context,
continuation) pairs against a ``moectl serve MODEL`` started here on a free loopback port; moectl's
in-process lm-eval model (``moectl.eval.lm_backend.MoectlLM``, the one ``moectl eval`` uses) scores
the same pairs. Printed: pairs/s of each, their ratio (measured in one run), and the largest
difference between the two log-likelihoods (in bf16 the two batch the pairs differently, so they
may differ by bf16 rounding; ``--dtype float32`` compares them exactly).

    python benchmarks/lm_eval_server.py --model models/moectl-small-standard --pairs 64 --json lm_eval_server.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import PROMPTS, fail
from moectl.io.atomic import write_text_atomic
from serve_load import free_port, start, stop


def pairs_of(n: int) -> list[tuple[str, str]]:
    """``n`` (context, continuation) pairs from the serving prompts: a prompt, then a word of another."""
    words = [p.split()[-1] for p in PROMPTS]
    return [(PROMPTS[i % len(PROMPTS)], " " + words[(i * 7 + 3) % len(words)]) for i in range(n)]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/moectl-small-standard", help="a checkpoint folder with its tokenizer")
    ap.add_argument("--pairs", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="prompts per request (lm-eval's batch_size)")
    ap.add_argument("--concurrent", type=int, default=2, help="requests at once (lm-eval's num_concurrent)")
    ap.add_argument("--threads", type=int, default=None, help="the server's torch threads and this process's")
    ap.add_argument("--dtype", default="auto", help="weights dtype of both (auto: the checkpoint's)")
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args(argv)
    if args.pairs < 1 or args.batch < 1 or args.concurrent < 1:
        fail("--pairs, --batch and --concurrent must be at least 1")
    if not (Path(args.model) / "tokenizer.json").exists() and not (Path(args.model) / "tokenizer_config.json").exists():
        fail(f"--model {args.model!r} must be a checkpoint folder with its tokenizer (lm-eval loads it)")
    import torch
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from moectl.eval.lm_backend import MoectlLM

    if args.threads:
        torch.set_num_threads(args.threads)
    pairs = pairs_of(args.pairs)
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]

    local = MoectlLM(args.model, batch_size=args.batch, dtype=args.dtype)
    local.loglikelihood(requests[: args.batch])  # warm-up
    t0 = time.perf_counter()
    expect = local.loglikelihood(requests)
    in_process = time.perf_counter() - t0
    del local

    port = free_port()
    command = [sys.executable, "-m", "moectl.cli", "serve", args.model, "--port", str(port), "--log-level", "warning",
               "--dtype", args.dtype]  # fmt: skip
    if args.threads:
        command += ["--threads", str(args.threads)]
    proc, base, _ = start(command, port)
    try:
        name = Path(args.model).name
        api = LocalCompletionsAPI(
            base_url=f"{base}/v1/completions", model=name, tokenizer=args.model, tokenizer_backend="huggingface",
            batch_size=args.batch, num_concurrent=args.concurrent, max_retries=1,
        )  # fmt: skip
        api.loglikelihood(requests[: args.batch])  # warm-up
        t0 = time.perf_counter()
        got = api.loglikelihood(requests)
        served = time.perf_counter() - t0
    finally:
        status = stop(proc)
    diff = max(abs(a[0] - b[0]) for a, b in zip(got, expect, strict=True))
    greedy_same = sum(a[1] == b[1] for a, b in zip(got, expect, strict=True))
    result = {
        "model": args.model,
        "pairs": args.pairs,
        "batch": args.batch,
        "concurrent": args.concurrent,
        "dtype": args.dtype,
        "in_process_pairs_per_s": args.pairs / in_process,
        "served_pairs_per_s": args.pairs / served,
        "served_over_in_process": in_process / served,
        "max_abs_loglikelihood_difference": diff,
        "greedy_flags_equal": greedy_same,
        "server_exit_status": status,
    }
    print(f"in process (MoectlLM): {result['in_process_pairs_per_s']:.1f} pairs/s")
    print(f"through moectl serve (lm-eval local-completions, batch {args.batch}, {args.concurrent} at once): "
          f"{result['served_pairs_per_s']:.1f} pairs/s = {result['served_over_in_process']:.2f}x in process")  # fmt: skip
    print(f"largest log-likelihood difference {diff:.2e}; greedy flags equal for {greedy_same}/{args.pairs}")
    if args.json_path:
        write_text_atomic(args.json_path, json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json_path}")
    return result


if __name__ == "__main__":
    main()
