"""EMO vs standard pretraining on the same data and token budget (issue: corpus and pretrained MoEs).

Trains ``--preset`` with the standard and the EMO objective (or, with ``--report-only``, reads
runs that already exist), then prints in one table: training tokens/s of each and EMO's overhead
ratio (goal <= 1.05), and validation loss per domain as a full model (EMO Table 1: EMO within 2% of
standard). Writes the table to ``--json`` and copies each run's config and log (not weights) to
``benchmarks/results/pretrain/`` so anyone can retrain with one command.

    python benchmarks/pretrain.py --preset small --corpus data/corpus --max-steps 400 --micro-batch 8
    python benchmarks/pretrain.py --report-only --runs runs/standard-small runs/emo-small

``--speed`` measures one training step of ``--preset`` under each optimisation in turn (fp32,
transformers' default experts and loss, foreach AdamW as before; bf16 autocast; moectl's padded
grouped expert GEMMs; the fused chunked LM-head cross-entropy; fused AdamW; a page-keeping
allocator), each in a fresh process, and prints tokens/s, speed-up over the first row, and MFU
against the bf16 matmul peak measured in the same process (``moectl.train.speed``):

    python benchmarks/pretrain.py --speed --preset small --json benchmarks/results/pretrain_speed.json

A second table splits each row's step into matmul kernels, attention kernels and the rest (two
profiled steps) and prints the MFU ceiling: the MFU if the rest took no time. ``--model KEY=INT``
(repeatable) widens or narrows the preset, to see how MFU moves with the matrices' sizes; ``--rows
0,5`` measures only those rows of the first table (the speed-up column is over the first one given):

    python benchmarks/pretrain.py --speed --rows 0,5 --model hidden_size=1024 --model head_dim=64 \
        --model num_attention_heads=16 --model num_key_value_heads=8 --model moe_intermediate_size=512 \
        --model shared_expert_intermediate_size=1024 --json benchmarks/results/pretrain_speed_wide.json

``--precision`` trains ``--preset`` twice for ``--max-steps`` steps (default 400), same data, order,
seed and configuration (the reference models': ``--lb-window 64``), once with bf16 autocast (moectl
pretrain's default on CPU) and once in fp32, and prints both validation losses on the whole
validation split and their relative difference (issue 14.1's goal: within 1%). ``--seeds 0 1 2``
repeats the pair per seed and adds the mean paired difference with its 95% t interval and each
precision's seed-to-seed spread (one pair cannot tell a precision effect from a seed's); ``--jobs 2``
runs two at once, one thread each. The runs resume where they stopped (run it again with the same
``--out``):

    python benchmarks/pretrain.py --precision --preset small --corpus data/corpus --out runs \
        --seeds 0 1 2 --jobs 2 --json benchmarks/results/pretrain_precision.json \
        --plot benchmarks/results/pretrain_precision.png
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from moectl.train.loop import pretrain
from moectl.train.train_config import TrainConfig

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


def _speed_chain() -> list[tuple[str, dict, str]]:
    """(label, knobs, allocator) of each ``--speed`` row: each row adds one change to the row above."""
    # before: fp32, transformers' default experts (its grouped_mm: fp32 weights), transformers' loss,
    # torch's default (foreach) AdamW; then one change at a time, all under tcmalloc (glibc's step
    # times vary 1.3-8.8 s: allocator.py); the last row is moectl pretrain's step under glibc
    steps = [
        ("fp32, default experts, HF loss (before)", {}, "system"),
        ("+ tcmalloc", {}, "fast"),
        ("+ bf16 autocast", {"bf16": True}, "fast"),
        ("+ grouped expert GEMMs in bf16", {"experts_implementation": "moectl_grouped"}, "fast"),
        ("+ fused chunked cross-entropy", {"fused_ce": True}, "fast"),
        ("+ fused AdamW (moectl pretrain)", {"fused_adamw": True}, "fast"),
        ("same, glibc allocator", {}, "system"),
    ]
    knobs = {"bf16": False, "experts_implementation": "grouped_mm", "fused_ce": False, "fused_adamw": False}
    rows = []
    for label, change, allocator in steps:
        knobs = {**knobs, **change}
        rows.append((label, knobs, allocator))
    return rows


SPEED_VARIANTS = _speed_chain()


def _speed_variant(spec: str) -> None:
    """Child process: measure one variant, print its JSON on the last line."""
    from moectl.train.allocator import current_allocator
    from moectl.train.speed import measure_training

    args = json.loads(spec)
    config = TrainConfig.from_preset(args.pop("preset"), **args)
    result = measure_training(config, breakdown=True)
    print(json.dumps({**result, "allocator": current_allocator()}))


def speed(
    preset: str,
    corpus: str | None,
    threads: int,
    json_path: Path | None,
    model: dict | None = None,
    only: list[int] | None = None,
) -> None:
    from moectl.train.allocator import fast_allocator_env

    rows = []
    with tempfile.TemporaryDirectory() as out:
        for i, (label, knobs, allocator) in enumerate(SPEED_VARIANTS):
            if only is not None and i not in only:
                continue
            env, _ = (
                fast_allocator_env()
                if allocator == "fast"
                else (dict(os.environ, MOECTL_ALLOCATOR="system"), "")
            )
            env["OMP_NUM_THREADS"] = str(threads)
            spec = json.dumps(
                {
                    "preset": preset,
                    "out": out,
                    "corpus": corpus,
                    "max_steps": 400,
                    "model": model or {},
                    **knobs,
                }
            )
            proc = subprocess.run(
                [sys.executable, __file__, "--speed-variant", spec], env=env, capture_output=True, text=True
            )
            if proc.returncode != 0:
                raise SystemExit(f"{label}: failed\n{proc.stderr[-2000:]}")
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append({"variant": label, **knobs, **result})
            print(f"{label:<48}{result['tokens_per_s']:>8.0f} tok/s", flush=True)
    # one peak for every row: the best bf16 matmul any of the processes measured
    peak = max(r["peak_bf16_flops"] for r in rows)
    base = rows[0]["tokens_per_s"]
    print(f"\n{'variant':<48}{'tok/s':>8}{'x before':>10}{'MFU':>8}{'step s (median, min)':>22}  allocator")
    for r in rows:
        r["mfu"] = r["flops_per_token"] * r["tokens_per_s"] / peak
        print(
            f"{r['variant']:<48}{r['tokens_per_s']:>8.0f}{r['tokens_per_s'] / base:>10.2f}"
            f"{100 * r['mfu']:>7.1f}%{r['step_s']:>13.3f}, {r['step_s_min']:.3f}  {r['allocator']}"
        )
    r = rows[-1]
    print(
        f"\nmodel {r['flops_per_token'] / 1e6:.1f} MFLOP/token; bf16 matmul peak {peak / 1e9:.0f} GFLOP/s "
        f"(best of the rows' 2048² measurements, {threads} threads); fp32 {r['peak_fp32_flops'] / 1e9:.0f}; goal MFU >= 40%"
    )
    print_kernels(rows, peak)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(
            json.dumps(
                {
                    "preset": preset,
                    "model": model or {},
                    "threads": threads,
                    "peak_bf16_flops": peak,
                    "rows": rows,
                },
                indent=2,
            )
        )


def model_overrides(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, int]:
    """``--model KEY=INT`` pairs as a dict; a key the preset lacks or a non-integer exits with 2."""
    from moectl.train.train_config import MODEL_PRESETS

    allowed = MODEL_PRESETS.get(args.preset, {})
    out = {}
    for item in args.model:
        key, _, value = item.partition("=")
        if key not in allowed or not value.isdigit() or int(value) < 1:
            parser.error(
                f"--model {item}: expected KEY=INT with INT >= 1 and KEY one of {', '.join(allowed)}"
            )
        out[key] = int(value)
    return out


def print_kernels(rows: list[dict], peak: float) -> None:
    """Where each row's step goes (``moectl.train.speed.kernel_breakdown``, two profiled steps) and
    the MFU ceiling: the MFU if everything but the matmul and attention kernels took no time."""
    print(
        f"\n{'variant':<48}{'step ms':>8}{'matmul':>8}{'attn':>8}{'other':>8}"
        f"{'matmul GFLOP/s':>16}{'attn GFLOP/s':>14}{'MFU ceiling':>13}"
    )
    for r in rows:
        k = r["kernels"]
        r["mfu_ceiling"] *= r["peak_bf16_flops"] / peak  # measure_training's ceiling, over the common peak
        attn = f"{r['attention_flops'] / 1e9:>14.0f}" if r["attention_flops"] else f"{'–':>14}"
        print(
            f"{r['variant']:<48}{1e3 * k['step_s']:>8.0f}{1e3 * k['matmul_s']:>8.0f}{1e3 * k['attention_s']:>8.0f}"
            f"{1e3 * k['other_s']:>8.0f}{r['matmul_flops'] / 1e9:>16.0f}{attn}{100 * r['mfu_ceiling']:>12.1f}%"
        )
    print("(ms per profiled step; GFLOP/s = the model's FLOPs of that kind over its kernels' time)")


def _precision_run(args: argparse.Namespace, label: str, seed: int) -> tuple[Path, list[str] | None]:
    """The run folder of one (precision, seed) and the ``moectl pretrain`` command that finishes it
    (None: already finished). Seed 0 keeps the folder name of the first runs."""
    run = Path(args.out) / (f"precision-{label}-{args.preset}" + (f"-seed{seed}" if seed else ""))
    if (run / "final").exists():
        return run, None
    command = [sys.executable, "-m", "moectl", "pretrain"]
    if (run / "config.json").exists():
        return run, [*command, "--resume", str(run)]
    steps = args.max_steps or 400
    command += [
        "--preset", args.preset, "--objective", "standard", "--out", str(run),
        "--bf16" if label == "bf16" else "--no-bf16", "--max-steps", str(steps),
        "--warmup-steps", str(min(40, steps // 10)), "--eval-every", "0", "--lb-window", "64",
        "--seed", str(seed),
    ]  # fmt: skip
    for option, value in (("--corpus", args.corpus), ("--tokenizer", args.tokenizer)):
        command += [option, str(value)] if value else []
    command += ["--micro-batch", str(args.micro_batch)] if args.micro_batch else []
    return run, command


def precision(args: argparse.Namespace) -> None:
    """bf16 autocast vs fp32 after the same steps, for each seed (see the module docstring). Each run
    is a ``moectl pretrain`` process of its own (accelerate fixes the precision once per process);
    ``--jobs N`` runs N at once, one thread each."""
    seeds = args.seeds or [0]
    runs = {(label, seed): _precision_run(args, label, seed) for seed in seeds for label in ("bf16", "fp32")}
    pending = [(key, command) for key, (_, command) in runs.items() if command]
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if args.jobs > 1 else None
    while pending:
        batch, pending = pending[: args.jobs], pending[args.jobs :]
        procs = [(key, subprocess.Popen(command, env=env)) for key, command in batch]
        for (label, seed), proc in procs:
            if proc.wait() != 0:
                raise SystemExit(
                    f"{label} seed {seed}: moectl pretrain failed (resume: run this benchmark again)"
                )
    rows = {_key(label, seed): summarise(run) for (label, seed), (run, _) in runs.items()}
    per_seed = []
    print(f"{'seed':<6}{'bf16':>10}{'fp32':>10}{'bf16/fp32 - 1':>16}")
    for seed in seeds:
        a, b = rows[_key("bf16", seed)]["val_loss"], rows[_key("fp32", seed)]["val_loss"]
        per_seed.append(a / b - 1)
        print(f"{seed:<6}{a:>10.4f}{b:>10.4f}{100 * per_seed[-1]:>+15.2f}%")
    mean = statistics.fmean(per_seed)
    summary: dict = {"seeds": seeds, "relative_difference_per_seed": per_seed, "relative_difference": mean}
    if len(seeds) > 1:
        half = _t95(len(seeds)) * statistics.stdev(per_seed) / len(seeds) ** 0.5
        summary["relative_difference_ci95"] = [mean - half, mean + half]
        for label in ("bf16", "fp32"):
            losses = [rows[_key(label, s)]["val_loss"] for s in seeds]
            summary[f"seed_spread_{label}"] = max(losses) / min(losses) - 1
        print(
            f"mean {100 * mean:+.2f}% [{100 * (mean - half):+.2f}%, {100 * (mean + half):+.2f}%] (paired over "
            f"{len(seeds)} seeds, t interval; goal: within 1%); seed spread bf16 "
            f"{100 * summary['seed_spread_bf16']:.2f}%, fp32 {100 * summary['seed_spread_fp32']:.2f}%"
        )
    print(
        f"tokens/s (one run each): bf16 {rows['bf16']['tokens_per_s']:.0f}, fp32 {rows['fp32']['tokens_per_s']:.0f}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**rows, **summary}, indent=2) + "\n")
    if args.plot:
        plot_precision(rows, args.plot)


def _key(label: str, seed: int) -> str:
    """A run's key in the results JSON: ``bf16``, ``fp32`` for seed 0, ``bf16_seed1`` … otherwise."""
    return label + (f"_seed{seed}" if seed else "")


# two-sided 95% Student t quantiles by degrees of freedom (1–30)
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042)  # fmt: skip


def _t95(n: int) -> float:
    """Two-sided 95% Student t quantile for n paired differences (n − 1 degrees of freedom); beyond
    30 degrees of freedom the quantile at 30 (an interval slightly wider than exact)."""
    return _T95[min(n - 1, len(_T95)) - 1]


def plot_precision(rows: dict, path: Path) -> None:
    """Training cross-entropy against the step for each run (the steps the log records; a seed's two
    runs see the same batches): bf16 solid, fp32 dashed, one colour per seed, each labelled with its
    final validation loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    colours = {}
    for label, row in rows.items():
        precision_name, _, seed = label.partition("_seed")
        colour = colours.setdefault(seed or "0", f"C{len(colours)}")
        logged = [
            json.loads(x) for x in (Path(row["run"]) / "log.jsonl").read_text().splitlines() if x.strip()
        ]
        steps = [r for r in logged if "ce" in r and not r.get("final")]
        ax.plot([r["step"] + 1 for r in steps], [r["ce"] for r in steps], lw=1.2, color=colour,
                ls="-" if precision_name == "bf16" else "--",
                label=f"{precision_name} seed {seed or 0}: validation loss {row['val_loss']:.4f}")  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("training cross-entropy (nats)")
    ax.set_title("bf16 autocast (solid) vs fp32 (dashed): same data, order and steps per seed", fontsize=10)
    ax.legend(frameon=False, fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="small")
    parser.add_argument("--corpus", default=None)
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--out", default="runs")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument(
        "--runs", nargs=2, type=Path, help="standard and EMO run directories (with --report-only)"
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--speed", action="store_true", help="measure the training step's speed-ups and MFU")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="KEY=INT",
        help="with --speed: override a model dimension of the preset (repeatable), e.g. hidden_size=512",
    )
    parser.add_argument("--rows", help="with --speed: only these rows (0-based, comma-separated), e.g. 0,5")
    parser.add_argument("--precision", action="store_true", help="bf16 autocast vs fp32 validation loss")
    parser.add_argument("--plot", type=Path, default=None, help="with --precision: the loss curves as a PNG")
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=None, help="with --precision: seeds (default 0)"
    )
    parser.add_argument("--jobs", type=int, default=1, help="with --precision: runs at once, one thread each")
    parser.add_argument("--speed-variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.precision:
        return precision(args)
    if args.speed_variant:
        return _speed_variant(args.speed_variant)
    if args.speed:
        only = None
        if args.rows:
            only = [int(x) for x in args.rows.split(",") if x.isdigit() and int(x) < len(SPEED_VARIANTS)]
            if len(only) != len(args.rows.split(",")):
                parser.error(
                    f"--rows {args.rows}: expected comma-separated row numbers 0..{len(SPEED_VARIANTS) - 1}"
                )
        return speed(args.preset, args.corpus, args.threads, args.json, model_overrides(parser, args), only)
    args.json = args.json or RESULTS / "summary.json"
    runs = args.runs or [Path(args.out) / f"{objective}-{args.preset}" for objective in ("standard", "emo")]
    if not args.report_only:
        for objective, run in zip(("standard", "emo"), runs, strict=True):
            config = TrainConfig.from_preset(
                args.preset,
                out=str(run),
                objective=objective,
                corpus=args.corpus,
                tokenizer=args.tokenizer,
                max_steps=args.max_steps,
                micro_batch=args.micro_batch,
                eval_every=100,
            )
            pretrain(config)
    std, emo = (summarise(run) for run in runs)
    domains = sorted(std["val_loss_per_domain"])
    print(f"{'':<14}{'standard':>12}{'EMO':>12}{'EMO/std':>10}")
    print(f"{'tokens':<14}{std['tokens']:>12,}{emo['tokens']:>12,}")
    ratio = std["tokens_per_s"] / emo["tokens_per_s"]
    print(
        f"{'tokens/s':<14}{std['tokens_per_s']:>12.0f}{emo['tokens_per_s']:>12.0f}{ratio:>10.3f}  (time overhead, goal <= 1.05)"
    )
    for domain in domains:
        a, b = std["val_loss_per_domain"][domain], emo["val_loss_per_domain"].get(domain, float("nan"))
        print(f"{'val ' + domain:<14}{a:>12.4f}{b:>12.4f}{b / a:>10.3f}")
    print(
        f"{'val all':<14}{std['val_loss']:>12.4f}{emo['val_loss']:>12.4f}{emo['val_loss'] / std['val_loss']:>10.3f}  (goal: within 2%)"
    )
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
