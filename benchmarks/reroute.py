"""Cache-aware rerouting (``reroute:TOL``): misses saved against tokens changed.

For each tolerance, serves ``--prompts`` prompts (the first ``--chars`` characters of the bundled
corpus sample's documents) one at a time with ``--budget`` experts resident per MoE layer and
generates ``--max-new-tokens`` greedy tokens each; ``s3fifo`` (the model's own routing, the same
residency) is the reference. Reports the hit rate, loads per generated token, experts rerouted per
generated token, and the fraction of generated tokens equal to the reference's at the same position
(greedy decoding: after the first difference the continuations may part):

    OMP_NUM_THREADS=1 python benchmarks/reroute.py --model models/moectl-small-standard --budget 8 \
        --json benchmarks/results/reroute_moectl-small-standard.json
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import torch

import moectl
from moectl.models.load import load_model
from moectl.offload.runtime import offload

SAMPLE = Path(__file__).resolve().parents[1] / "src" / "moectl" / "data" / "sample" / "test.jsonl.gz"


def serve(model, prompts: list[torch.Tensor], budget: int, policy: str, new: int) -> dict:
    outs = []
    with offload(model, budget, policy, store="host") as rt, moectl.route(model, rt.policy.routing(rt.info)):
        for ids in prompts:
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, pad_token_id=0)  # fmt: skip
            outs.append(out[0, ids.shape[1] :])
        totals = rt.totals()
    generated = sum(o.numel() for o in outs)
    return {
        "policy": policy,
        "hit_rate": totals["hits"] / (totals["hits"] + totals["misses"]),
        "loads_per_token": totals["loads"] / generated,
        "rerouted_per_token": getattr(rt.policy, "rerouted", 0) / generated,
        "tokens": outs,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/moectl-small-standard")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--chars", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--budget", type=int, default=8)
    parser.add_argument("--tols", default="0.01,0.02,0.05,0.1")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    model, tok = load_model(args.model)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # offloading runs the experts' own forward
    with gzip.open(SAMPLE, "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["text"][: args.chars] for _, line in zip(range(args.prompts), f, strict=False)]
    prompts = [tok([t], return_tensors="pt")["input_ids"] for t in texts]  # [1, n] each
    reference = serve(model, prompts, args.budget, "s3fifo", args.max_new_tokens)
    rows = [reference]
    for tol in args.tols.split(","):
        rows.append(serve(model, prompts, args.budget, f"reroute:{float(tol):g}", args.max_new_tokens))
    expected = reference["tokens"]
    total = sum(t.numel() for t in expected)
    print(f"{args.model}, budget {args.budget}, {len(prompts)} prompts × {args.max_new_tokens} greedy tokens")
    print(f"{'policy':<16}{'hit rate':>10}{'loads/token':>13}{'rerouted/token':>16}{'same tokens':>13}")
    for r in rows:
        same = sum(int((a == b).sum()) for a, b in zip(r.pop("tokens"), expected, strict=True))
        r["same_tokens"] = same / total
        print(f"{r['policy']:<16}{r['hit_rate']:>10.3f}{r['loads_per_token']:>13.2f}"
              f"{r['rerouted_per_token']:>16.2f}{r['same_tokens']:>13.1%}")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {**{k: v for k, v in vars(args).items() if k != "json"}, "routing": "learned weights", "rows": rows}
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
