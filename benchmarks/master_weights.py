"""bf16 fine-tuning with and without float32 master weights, against the same run in float32.

Fine-tunes ``--model`` for ``--steps`` steps of ``moectl subset finetune``'s loop (EMO appendix C
settings: lr 5e-5, linear decay) on the first training documents of ``--corpus``, three times from
the same weights: in float32 (the reference), in bf16 stepping the bf16 weights, and in bf16 through
float32 masters (``moectl.train.master_weights``). Prints, per run, the fraction of weights that
changed, and for the bf16 runs the fraction of the entries whose bf16 rounding the float32 run moved
that reached the float32 run's value:

    python benchmarks/master_weights.py --model models/moectl-small-standard --corpus data/corpus \
        --json benchmarks/results/master_weights.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from moectl.data.jsonl import read_jsonl_rows
from moectl.models.load import load_model
from moectl.subsets.finetune import finetune_subset


def run(
    model_spec: str, docs: list[str], dtype: str, masters: bool, settings: dict
) -> dict[str, torch.Tensor]:
    model, tok = load_model(model_spec, dtype=dtype)
    finetune_subset(model, tok, docs, master_weights=masters, **settings)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="models/moectl-small-standard")
    parser.add_argument("--corpus", default="data/corpus")
    parser.add_argument("--docs", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    docs = [d["text"][:400] for d in read_jsonl_rows(Path(args.corpus) / "train.jsonl", "text", args.docs)]
    settings = dict(lr=args.lr, batch_size=8, micro_batch_size=8, max_steps=args.steps, max_length=128)
    start, _ = load_model(args.model, dtype="float32")
    base = {n: p.detach().clone() for n, p in start.named_parameters()}
    reference = run(args.model, docs, "float32", True, settings)
    target = {n: p.bfloat16() for n, p in reference.items()}
    moved = {n: target[n] != base[n].bfloat16() for n in target}
    n_moved = sum(int(m.sum()) for m in moved.values())
    n_all = sum(m.numel() for m in moved.values())

    def changed(weights: dict, against: dict) -> float:
        return sum(int((weights[n] != against[n]).sum()) for n in weights) / n_all

    rows = [{"run": "float32", "changed": changed(reference, base)}]
    for masters in (False, True):
        weights = run(args.model, docs, "bfloat16", masters, settings)
        same = sum(int(((weights[n] == target[n]) & moved[n]).sum()) for n in weights)
        rows.append(
            {
                "run": f"bf16, {'float32 masters' if masters else 'no masters'}",
                "changed": changed(weights, {n: p.bfloat16() for n, p in base.items()}),
                "reached_float32": same / n_moved,
            }
        )
    print(
        f"{args.steps} steps at lr {args.lr:g}; the float32 run moved the bf16 rounding of {n_moved / n_all:.1%} of weights"
    )
    print(f"{'run':<28}{'weights changed':>17}{'reached float32':>17}")
    for r in rows:
        reached = f"{r['reached_float32']:.1%}" if "reached_float32" in r else "–"
        print(f"{r['run']:<28}{r['changed']:>17.1%}{reached:>17}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {**vars(args), "json": str(args.json), "moved": n_moved / n_all, "rows": rows}, indent=2
            )
        )


if __name__ == "__main__":
    main()
