"""EMO Figure 3 in miniature: held-out loss of per-domain expert subsets, standard MoE vs EMO.

For each domain of the corpus: select experts with the router method (mean routing probability,
EMO's default) on a few validation documents, keep 100%, 50%, 25% and 12.5% of the routed experts
(the shared expert always stays), and measure held-out (test split) loss of the subset model —
routing restricted with ``ExpertMask(renorm="pruned")``, which equals the physically exported
subset — relative to the full model. EMO's claim: ≈1% loss at 25% and ≈3% at 12.5%, while a
standard MoE degrades sharply.

``--finetune`` adds EMO's "with fine-tuning" rows (Figure 3 bottom, appendix C): each subset is
sliced out (``slice_experts``, the exported checkpoint), fine-tuned on that domain's training
documents (loss on every token, AdamW, linear decay, effective batch ``--ft-batch``) for a small
budget (``--ft-docs`` documents, at most ``--ft-steps`` steps), and its held-out loss measured
again, relative to the same un-fine-tuned full model.

    python benchmarks/subset_retention.py --models runs/standard-small/final runs/emo-small/final --corpus data/corpus
    python benchmarks/subset_retention.py --models ... --finetune --ft-docs 64 --ft-steps 20 --ft-lr 1e-4
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch

from moectl.adapters.inspect import inspect
from moectl.adapters.slicing import slice_experts
from moectl.data.domains import corpus_texts_by_domain
from moectl.models.load import load_model
from moectl.routing import ExpertMask
from moectl.subsets.calibrate import tokenize
from moectl.subsets.finetune import finetune_subset
from moectl.subsets.gating import mean_loss
from moectl.subsets.select import select_subset


def finetuned_loss(model, tokenizer, keep: dict, train: list[str], heldout: list[str], args) -> float:
    """Held-out loss of the subset sliced out of ``model`` and fine-tuned on ``train`` (EMO appendix C)."""
    subset = slice_experts(copy.deepcopy(model), keep)
    finetune_subset(
        subset, tokenizer, train, lr=args.ft_lr, batch_size=args.ft_batch, micro_batch_size=args.ft_micro,
        max_length=args.max_length, max_steps=args.ft_steps, epochs=args.ft_epochs,
    )  # fmt: skip
    return mean_loss(subset, tokenizer, heldout, max_length=args.max_length)


def retention(
    name: str, model_path: str, calib: dict, heldout: dict, train: dict | None, fractions: list[float], args
) -> dict:
    model, tokenizer = load_model(model_path, dtype="float32")
    info = inspect(model)
    results = {}
    for domain in sorted(heldout):
        full = mean_loss(model, tokenizer, heldout[domain], max_length=args.max_length)
        batch = tokenize(tokenizer, calib[domain], args.max_length)
        row = {"full": full}
        for fraction in fractions:
            k = max(info.top_k, round(info.num_experts * fraction))
            with torch.no_grad():
                keep = select_subset(
                    model, batch["input_ids"], k, "router", batch["attention_mask"], info=info
                )
            policy = ExpertMask.from_lists(info, keep, renorm="pruned")
            loss = mean_loss(model, tokenizer, heldout[domain], [policy], max_length=args.max_length)
            row[f"{fraction:g}"] = {"k": k, "loss": loss, "relative": loss / full - 1}
            if train is not None:
                tuned = finetuned_loss(model, tokenizer, keep, train[domain], heldout[domain], args)
                row[f"{fraction:g}"]["finetuned"] = {"loss": tuned, "relative": tuned / full - 1}
        results[domain] = row
        tuned = ("  ft " + "  ".join(f"{f:g}: {row[f'{f:g}']['finetuned']['relative']:+.1%}" for f in fractions)
                 if train is not None else "")  # fmt: skip
        print(
            f"  {Path(model_path).parent.name:<16}{domain:<8} full {full:.3f}  "
            + "  ".join(f"{f:g}: {row[f'{f:g}']['relative']:+.1%}" for f in fractions)
            + tuned,
            flush=True,
        )
    return results


def summary(results: dict, fractions: list[float], field: str | None = None) -> None:
    """Mean relative loss increase per kept fraction, standard vs EMO (``field``: "finetuned" rows)."""
    print(f"{'kept':<10}{'k':>4}{'standard':>12}{'EMO':>12}")
    for fraction in fractions:
        key = f"{fraction:g}"
        means = [
            sum((r[d][key][field] if field else r[d][key])["relative"] for d in r) / len(r)
            for r in results.values()
        ]
        k = next(iter(results["standard"].values()))[key]["k"]
        print(f"{fraction:<10.1%}{k:>4}{means[0]:>+12.2%}{means[1]:>+12.2%}")


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
    ft = parser.add_argument_group("fine-tuning (EMO appendix C, small budget)")
    ft.add_argument("--finetune", action="store_true", help="also fine-tune each subset before measuring")
    ft.add_argument("--ft-docs", type=int, default=64, help="training documents per domain")
    ft.add_argument("--ft-steps", type=int, default=20, help="at most this many optimiser steps")
    ft.add_argument("--ft-epochs", type=int, default=1)
    ft.add_argument("--ft-lr", type=float, default=5e-5, help="EMO: 5e-5")
    ft.add_argument("--ft-batch", type=int, default=32, help="effective batch (EMO: 32)")
    ft.add_argument("--ft-micro", type=int, default=8, help="micro-batch (gradient accumulation)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.corpus is None:
        from moectl.data.sample import sample_corpus_dir

        args.corpus = str(sample_corpus_dir())
    fractions = [float(f) for f in args.fractions.split(",")]
    calib = corpus_texts_by_domain(args.corpus, args.calib_docs, "validation")
    heldout = corpus_texts_by_domain(args.corpus, args.eval_docs, "test")
    train = corpus_texts_by_domain(args.corpus, args.ft_docs, "train") if args.finetune else None
    results = {
        name: retention(name, path, calib, heldout, train, fractions, args)
        for name, path in zip(("standard", "emo"), args.models, strict=True)
    }
    print(f"\nmean relative loss increase over {len(heldout)} domains (held-out test documents)")
    summary(results, fractions)
    if args.finetune:
        print("\nafter fine-tuning each subset (relative to the full model without fine-tuning)")
        summary(results, fractions, "finetuned")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k.startswith("ft_")} if args.finetune else None
    args.json.write_text(
        json.dumps({"models": args.models, "finetune": settings, "results": results}, indent=2)
    )


if __name__ == "__main__":
    main()
