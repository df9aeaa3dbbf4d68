"""EMO Figure 3 in miniature: held-out loss of per-domain expert subsets, standard MoE vs EMO.

For each domain of the corpus: select experts with the router method (mean routing probability,
EMO's default) on a few validation documents, keep 100%, 50%, 25% and 12.5% of the routed experts
(the shared expert always stays), and measure held-out (test split) loss of the subset model —
routing restricted with ``ExpertMask(renorm="pruned")``, which equals the physically exported
subset — relative to the full model. EMO's claim: ≈1% loss at 25% and ≈3% at 12.5%, while a
standard MoE degrades sharply. No subset fine-tuning here.

    python benchmarks/subset_retention.py --models runs/standard-small/final runs/emo-small/final --corpus data/corpus
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from moectl.adapters.inspect import inspect
from moectl.data.sample import iter_documents
from moectl.models.load import load_model
from moectl.routing import ExpertMask
from moectl.subsets.calibrate import tokenize
from moectl.subsets.gating import mean_loss
from moectl.subsets.select import select_subset


def texts_by_domain(corpus: str, split: str, per_domain: int) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for doc in iter_documents(corpus, split):
        bucket = out.setdefault(doc["domain"], [])
        if len(bucket) < per_domain:
            bucket.append(doc["text"])
    return out


@torch.no_grad()
def retention(
    name: str, model_path: str, calib: dict, heldout: dict, fractions: list[float], max_length: int
) -> dict:
    model, tokenizer = load_model(model_path, dtype="float32")
    info = inspect(model)
    results = {}
    for domain in sorted(heldout):
        full = mean_loss(model, tokenizer, heldout[domain], max_length=max_length)
        batch = tokenize(tokenizer, calib[domain], max_length)
        row = {"full": full}
        for fraction in fractions:
            k = max(info.top_k, round(info.num_experts * fraction))
            keep = select_subset(model, batch["input_ids"], k, "router", batch["attention_mask"], info=info)
            policy = ExpertMask.from_lists(info, keep, renorm="pruned")
            loss = mean_loss(model, tokenizer, heldout[domain], [policy], max_length=max_length)
            row[f"{fraction:g}"] = {"k": k, "loss": loss, "relative": loss / full - 1}
        results[domain] = row
        print(
            f"  {Path(model_path).parent.name:<16}{domain:<8} full {full:.3f}  "
            + "  ".join(f"{f:g}: {row[f'{f:g}']['relative']:+.1%}" for f in fractions),
            flush=True,
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs=2, required=True, help="standard and EMO checkpoints")
    parser.add_argument("--corpus", default=None, help="corpus folder (default: the bundled sample)")
    parser.add_argument("--calib-docs", type=int, default=8)
    parser.add_argument("--eval-docs", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--fractions", default="1,0.5,0.25,0.125")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/subset_retention.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.corpus is None:
        from moectl.data.sample import sample_corpus_dir

        args.corpus = str(sample_corpus_dir())
    fractions = [float(f) for f in args.fractions.split(",")]
    calib = texts_by_domain(args.corpus, "validation", args.calib_docs)
    heldout = texts_by_domain(args.corpus, "test", args.eval_docs)
    results = {
        name: retention(name, path, calib, heldout, fractions, args.max_length)
        for name, path in zip(("standard", "emo"), args.models, strict=True)
    }
    print(f"\nmean relative loss increase over {len(heldout)} domains (held-out test documents)")
    print(f"{'kept':<10}{'k':>4}{'standard':>12}{'EMO':>12}")
    for fraction in fractions:
        key = f"{fraction:g}"
        means = [sum(r[d][key]["relative"] for d in r) / len(r) for r in results.values()]
        k = next(iter(results["standard"].values()))[key]["k"]
        print(f"{fraction:<10.1%}{k:>4}{means[0]:>+12.2%}{means[1]:>+12.2%}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"models": args.models, "results": results}, indent=2))


if __name__ == "__main__":
    main()
