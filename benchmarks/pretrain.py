"""EMO vs standard pretraining on the same data and token budget (issue: corpus and pretrained MoEs).

Trains ``--preset`` with the standard and the EMO objective (or, with ``--report-only``, reads
runs that already exist), then prints in one table: training tokens/s of each and EMO's overhead
ratio (goal <= 1.05), and validation loss per domain as a full model (EMO Table 1: EMO within 2% of
standard). Writes the table to ``--json`` and copies each run's config and log (not weights) to
``benchmarks/results/pretrain/`` so anyone can retrain with one command.

    python benchmarks/pretrain.py --preset small --corpus data/corpus --max-steps 400 --micro-batch 8
    python benchmarks/pretrain.py --report-only --runs runs/standard-small runs/emo-small
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

from moectl.train.config import TrainConfig
from moectl.train.loop import pretrain

RESULTS = Path(__file__).parent / "results" / "pretrain"


def summarise(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines() if line.strip()]
    final = next(r for r in reversed(rows) if r.get("final"))
    speeds = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r and not r.get("final")]
    config = json.loads((run / "config.json").read_text())
    return {
        "run": str(run),
        "objective": config["objective"],
        "tokens": max(r.get("tokens", 0) for r in rows),
        "tokens_per_s": statistics.median(speeds[1:] or speeds),  # the first window includes start-up
        "val_loss": final["val_loss"],
        "val_loss_per_domain": final["val_loss_per_domain"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--corpus", default=None)
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--out", default="runs")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--runs", nargs=2, type=Path, help="standard and EMO run directories (with --report-only)")
    parser.add_argument("--json", type=Path, default=RESULTS / "summary.json")
    args = parser.parse_args()
    runs = args.runs or [Path(args.out) / f"{objective}-{args.preset}" for objective in ("standard", "emo")]
    if not args.report_only:
        for objective, run in zip(("standard", "emo"), runs, strict=True):
            config = TrainConfig.from_preset(
                args.preset, out=str(run), objective=objective, corpus=args.corpus, tokenizer=args.tokenizer,
                max_steps=args.max_steps, micro_batch=args.micro_batch, eval_every=100,
            )
            pretrain(config)
    std, emo = (summarise(run) for run in runs)
    domains = sorted(std["val_loss_per_domain"])
    print(f"{'':<14}{'standard':>12}{'EMO':>12}{'EMO/std':>10}")
    print(f"{'tokens':<14}{std['tokens']:>12,}{emo['tokens']:>12,}")
    ratio = std["tokens_per_s"] / emo["tokens_per_s"]
    print(f"{'tokens/s':<14}{std['tokens_per_s']:>12.0f}{emo['tokens_per_s']:>12.0f}{ratio:>10.3f}  (time overhead, goal <= 1.05)")
    for domain in domains:
        a, b = std["val_loss_per_domain"][domain], emo["val_loss_per_domain"].get(domain, float("nan"))
        print(f"{'val ' + domain:<14}{a:>12.4f}{b:>12.4f}{b / a:>10.3f}")
    print(f"{'val all':<14}{std['val_loss']:>12.4f}{emo['val_loss']:>12.4f}{emo['val_loss'] / std['val_loss']:>10.3f}  (goal: within 2%)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"standard": std, "emo": emo, "emo_time_overhead": ratio}, indent=2))
    for summary, run in zip((std, emo), runs, strict=True):
        target = RESULTS / run.name
        target.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "log.jsonl", "loss_curve.png"):
            if (run / name).exists():
                shutil.copy(run / name, target / name)
        summary["saved"] = str(target)


if __name__ == "__main__":
    main()
