"""What ``topk:N`` gives and costs (#41 item 3): decode tokens/s and KL to the model at each N.

For each N of ``--n`` (default: half the model's top-k and top-k itself): greedy engine decoding
tokens/s at each ``--batch`` size (every row under ``topk:N``; N = top-k is the model), alternating
the Ns ``--repeats`` times in one run (the median), and the mean per-token KL(model ‖ topk:N) of the
next-token distributions over ``--docs`` validation documents of the built-in sample corpus
(teacher-forced, ``--tokens`` tokens each). ``--model`` defaults to the shipped reference model.

    python benchmarks/topk_speed_kl.py --json benchmarks/results/topk_speed_kl.json
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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moectl
from bench_args import PROMPTS, fail, int_list
from moectl.data.sample import load_sample_corpus
from moectl.engine import Engine, EngineConfig, SamplingParams
from moectl.engine.engine import encode
from moectl.io.atomic import write_text_atomic


def kl_to_model(model, tok, n: int, docs: int, tokens: int) -> float:
    """Mean over positions of KL(p_model ‖ p_topk:N), teacher-forced on sample documents."""
    texts = [d["text"] for d in load_sample_corpus("validation")["validation"][:docs]]
    total, count = 0.0, 0
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([encode(tok, text)[:tokens]])
            ref = F.log_softmax(model(ids).logits.float(), -1)
            with moectl.route(model, f"topk:{n}"):
                got = F.log_softmax(model(ids).logits.float(), -1)
            total += float((ref.exp() * (ref - got)).sum(-1).sum())
            count += ids.shape[1]
    return total / count


def tokens_per_s(engine: Engine, routing: str, batch: int, tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    start = time.perf_counter()
    engine.generate(prompts, params, routing=routing)
    return batch * tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/moectl-small-standard")
    ap.add_argument("--n", default=None, help="comma list of N (default: top-k/2 and top-k)")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", dest="json_path", type=Path, default=None)
    args = ap.parse_args()
    batches = int_list(args.batch, "--batch")
    if min(batches) < 1 or args.tokens < 2 or args.repeats < 1 or args.docs < 1:
        fail("--batch sizes >= 1, --tokens >= 2, --repeats >= 1 and --docs >= 1")
    from moectl.threads import pick_threads

    threads = pick_threads(args.threads)
    torch.set_num_threads(threads)
    model, tok, info = moectl.load(args.model, dtype="bfloat16")
    k = info.top_k
    ns = int_list(args.n, "--n") if args.n else sorted({max(1, k // 2), k})
    routings = {f"top{n}": f"topk:{n}" for n in ns}
    rows = []
    with Engine(model, tok, EngineConfig(max_batch=max(batches)), routings=routings) as engine:
        tokens_per_s(engine, f"top{ns[0]}", 1, 4)  # warm-up
        for batch in batches:
            runs: dict[int, list[float]] = {n: [] for n in ns}
            for _ in range(args.repeats):
                for n in ns:
                    runs[n].append(tokens_per_s(engine, f"top{n}", batch, args.tokens))
            for n in ns:
                rows.append({"n": n, "batch": batch, "tok_s": statistics.median(runs[n]), "runs": runs[n]})
    kls = {n: kl_to_model(model, tok, n, args.docs, 256) for n in ns}
    base = {r["batch"]: r["tok_s"] for r in rows if r["n"] == k}
    print(f"{args.model} (top-k = {k}), bf16, {threads} threads, load average {os.getloadavg()[0]:.1f}")
    print(f"{'N':>3} {'batch':>5} {'tok/s':>8} {'vs top-k':>8} {'KL/token':>9}")
    for r in rows:
        r["vs_top_k"] = r["tok_s"] / base[r["batch"]] if r["batch"] in base else None
        r["kl_per_token"] = kls[r["n"]]
        ratio = f"{r['vs_top_k']:.2f}x" if r["vs_top_k"] is not None else "-"
        print(f"{r['n']:>3} {r['batch']:>5} {r['tok_s']:>8.1f} {ratio:>8} {kls[r['n']]:>9.4f}")
    if args.json_path is not None:
        result = {"model": args.model, "top_k": k, "threads": threads, "tokens": args.tokens, "docs": args.docs,
                  "loadavg": os.getloadavg(), "rows": rows}  # fmt: skip
        write_text_atomic(args.json_path, json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json_path}")


if __name__ == "__main__":
    main()
