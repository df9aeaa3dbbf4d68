"""TE-MoE Fig. 5 for several runs at once: reward, switch rate and KL to the teacher against the step.

Reads each run folder's ``log.jsonl`` (``moectl options train`` appends one row per step, also
while it runs) and draws one PNG, a column per curve and a colour per run: the raw values faint,
their running mean over a sliding window of 20 steps, and a bootstrap 95% band for that mean
(1000 resamples with replacement within the window, 2.5th–97.5th percentiles), as Fig. 5 does.

The log has no separate KL field: its ``reward`` is the mean of r_t = log p_teacher(a_t) −
log π(a_t) over the rollout's tokens (eq. 6), so the KL panel is −reward, the per-token reverse
KL(π ‖ p_teacher) estimated on tokens drawn from p_mix = (1 − τ)π + τ p_teacher (deviation: a
mixed-sample estimate, not an on-policy one; the log records nothing closer). The fourth panel is
the teacher's perplexity of the sampled tokens (``teacher_ppl``; §5: "perplexity also decreases").

    python benchmarks/options_curves.py --runs runs/options/std-k8-eta0.02 runs/options/std-k16-eta0.02 \\
        --out benchmarks/results/reference/options_curves.png --json benchmarks/results/reference/options_curves.json

``--json`` writes, per run, the steps logged and the windowed means (with their bootstrap 95%
intervals) of the first and last ``--window`` steps.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

# (key in the summary and the figure, title, how a log row gives it)
CURVES = (
    ("reward", "reward (log p_teacher − log π)", lambda row: row["reward"]),
    ("switch_rate", "switch rate", lambda row: row["switch_rate"]),
    ("kl", "KL(π ‖ teacher) per token (= −reward)", lambda row: -row["reward"]),
    ("teacher_ppl", "teacher ppl of the samples", lambda row: row["teacher_ppl"]),
)


def read_log(run: Path) -> list[dict]:
    """The rows of ``run/log.jsonl`` in step order; a last line still being written is left out.

    ``ValueError`` naming the file when there is no log, no row, or a broken line before the last.
    """
    path = run / "log.jsonl"
    if not path.is_file():
        raise ValueError(f"{run}: no log.jsonl (a folder written by `moectl options train` is needed)")
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # the trainer appends while we read: drop a half-written last row
                break
            raise ValueError(f"{path}: line {i + 1} is not JSON") from None
        missing = [k for k in ("step", "reward", "switch_rate", "teacher_ppl") if k not in row]
        if missing:
            raise ValueError(f"{path}: line {i + 1} lacks {', '.join(missing)} (not an options training log)")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows yet")
    return sorted(rows, key=lambda r: r["step"])


def running_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Mean of the last ``window`` values at each step (fewer at the start), Fig. 5's smoothing."""
    sums = np.cumsum(np.concatenate([[0.0], values]))
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    return (sums[ends] - sums[starts]) / (ends - starts)


def bootstrap_band(
    values: np.ndarray, window: int, resamples: int = 1000, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """2.5th and 97.5th percentiles of the running mean, resampling each window with replacement."""
    n = len(values)
    sizes = np.minimum(np.arange(1, n + 1), window)  # [S] values in each step's window
    rng = np.random.default_rng(seed)
    draws = (rng.random((n, resamples, window)) * sizes[:, None, None]).astype(np.int64)
    picked = values[np.arange(n)[:, None, None] - draws]  # [S, R, W] index back from the step
    used = np.arange(window)[None, None, :] < sizes[:, None, None]
    means = (picked * used).sum(-1) / sizes[:, None]
    return np.percentile(means, 2.5, axis=1), np.percentile(means, 97.5, axis=1)


def curves(rows: list[dict]) -> dict[str, np.ndarray]:
    out = {"step": np.array([r["step"] for r in rows], dtype=np.float64)}
    for key, _, get in CURVES:
        out[key] = np.array([get(r) for r in rows], dtype=np.float64)
    return out


def window_summary(values: np.ndarray, window: int, seed: int = 0) -> dict:
    """Mean of ``values`` and its bootstrap 95% interval (the last point of the band)."""
    low, high = bootstrap_band(values, window, seed=seed)
    return {"mean": float(values[-window:].mean()), "ci95": [float(low[-1]), float(high[-1])]}


def summarise(name: str, rows: list[dict], window: int) -> dict:
    data = curves(rows)
    first = min(window, len(rows))
    summary: dict = {
        "run": name,
        "steps_logged": len(rows),
        "last_step": int(data["step"][-1]),
        "seconds_per_step": float(np.mean([r.get("seconds", float("nan")) for r in rows])),
        "window": window,
    }
    for key, _, _ in CURVES:
        values = data[key]
        summary[key] = {
            f"first_{first}": window_summary(values[:first], window),
            f"last_{first}": window_summary(values[-first:], window),
        }
    per_layer = [r["switch_rate_per_layer"] for r in rows[-first:] if "switch_rate_per_layer" in r]
    if per_layer:
        summary["switch_rate_per_layer_last"] = np.mean(np.array(per_layer), 0).round(4).tolist()
    return summary


def plot(runs: dict[str, list[dict]], path: Path, window: int, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVES), figsize=(4.6 * len(CURVES), 4.0), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, rows) in enumerate(runs.items()):
        data, colour = curves(rows), colours[i % len(colours)]
        for ax, (key, label, _) in zip(axes[0], CURVES, strict=True):
            low, high = bootstrap_band(data[key], window, seed=i)
            ax.plot(data["step"], data[key], color=colour, alpha=0.25, lw=0.8)
            ax.fill_between(data["step"], low, high, color=colour, alpha=0.2, lw=0)
            ax.plot(
                data["step"],
                running_mean(data[key], window),
                color=colour,
                lw=1.8,
                label=f"{name} ({len(rows)} steps)",
            )
            ax.set_title(label, fontsize=10)
            ax.set_xlabel("step")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncols=min(len(runs), 4), fontsize=9, frameon=False)
    fig.suptitle(
        title or f"options training: raw (faint), running mean over {window} steps, bootstrap 95% band"
    )
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=Path, nargs="+", required=True, help="run folders holding log.jsonl")
    ap.add_argument("--out", type=Path, required=True, help="the PNG to write")
    ap.add_argument("--json", type=Path, default=None, help="also write the per-run summary here")
    ap.add_argument("--window", type=int, default=20, help="sliding window of the running mean (Fig. 5: 20)")
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    try:
        if args.window < 1:
            raise ValueError(f"--window must be >= 1, got {args.window}")
        if args.out.suffix.lower() != ".png":
            raise ValueError(f"--out must name a .png file, got {args.out}")
        names = [run.name for run in args.runs]
        if len(set(names)) != len(names):
            raise ValueError(
                f"--runs: two runs share a folder name ({', '.join(names)}); the legend needs each once"
            )
        runs = {run.name: read_log(run) for run in args.runs}
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    plot(runs, args.out, args.window, args.title)
    summary = {"window": args.window, "runs": [summarise(n, rows, args.window) for n, rows in runs.items()]}
    for s in summary["runs"]:
        last = f"last_{min(args.window, s['steps_logged'])}"
        print(
            f"{s['run']:<22} {s['steps_logged']:>4} steps  reward {s['reward'][last]['mean']:+.3f}  "
            f"switch {s['switch_rate'][last]['mean']:.3f}  KL {s['kl'][last]['mean']:.3f}  "
            f"teacher ppl {s['teacher_ppl'][last]['mean']:.1f}  ({last.replace('_', ' ')} steps)"
        )
    print(f"wrote {args.out}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json.with_name(args.json.name + ".tmp")
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        tmp.replace(args.json)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
