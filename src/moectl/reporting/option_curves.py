"""Options training curves (TE-MoE §5, "Training Dynamics", Fig. 5) read from a run's ``log.jsonl``.

``moectl options train`` appends one row per step to ``RUN/log.jsonl`` (also while it runs). This
module reads those rows and gives the curves of Fig. 5: reward, switch rate, KL to the teacher and
the teacher's perplexity of the samples against the step; their running mean over a sliding
window of 20 steps; and a bootstrap 95% band for that mean (1000 resamples with replacement within
the window, 2.5th–97.5th percentiles), as Fig. 5's caption describes. :func:`summarise` gives the
windowed means (with their bootstrap 95% intervals) of the first and last window of a run;
:func:`plot` draws one PNG, a column per curve and a colour per run.

The log has no separate KL field: its ``reward`` is the mean of r_t = log p_teacher(a_t) −
log π(a_t) over the rollout's tokens (eq. 6), so the KL curve is −reward, the per-token reverse
KL(π ‖ p_teacher) estimated on tokens drawn from p_mix = (1 − τ)π + τ p_teacher (eq. 7;
deviation: a mixed-sample estimate, not an on-policy one; the log records nothing closer). The
fourth curve is the teacher's perplexity of the sampled tokens (``teacher_ppl``; §5: "perplexity
also decreases").

Used by ``benchmarks/options_curves.py`` (several runs in one figure) and ``moectl options card``
(one run's card). Imports numpy only; matplotlib inside :func:`plot`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from moectl.errors import FileFormatError
from moectl.io.atomic import save_figure

__all__ = [
    "CURVES",
    "RESAMPLES",
    "WINDOW",
    "bootstrap_band",
    "curves",
    "plot",
    "read_log",
    "running_mean",
    "summarise",
    "window_summary",
]

WINDOW = 20  # Fig. 5's sliding window
RESAMPLES = 1000  # Fig. 5's bootstrap resamples per window

# (key in the summary and the figure, title, how a log row gives it)
CURVES = (
    ("reward", "reward (log p_teacher − log π)", lambda row: row["reward"]),
    ("switch_rate", "switch rate", lambda row: row["switch_rate"]),
    ("kl", "KL(π ‖ teacher) per token (= −reward)", lambda row: -row["reward"]),
    ("teacher_ppl", "teacher ppl of the samples", lambda row: row["teacher_ppl"]),
)


CARD_LOG = "training_log.jsonl"  # the log's name in a controller folder (``reporting/controller_card.py``)


def read_log(run: Path) -> list[dict]:
    """The rows of ``run/log.jsonl`` (a run folder) or ``run/training_log.jsonl`` (a controller
    folder written by ``moectl options card``) in step order; a last line still being written is
    left out.

    ``ValueError`` naming the file when there is no log, no row, or a broken line before the last.
    """
    path = run / "log.jsonl"
    if not path.is_file() and (run / CARD_LOG).is_file():
        path = run / CARD_LOG
    if not path.is_file():
        raise FileFormatError(
            f"{run}: no log.jsonl (a folder written by `moectl options train` or `moectl options card` is needed)"
        )
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # the trainer appends while we read: drop a half-written last row
                break
            raise FileFormatError(f"{path}: line {i + 1} is not JSON") from None
        missing = [k for k in ("step", "reward", "switch_rate", "teacher_ppl") if k not in row]
        if missing:
            raise FileFormatError(f"{path}: line {i + 1} lacks {', '.join(missing)} (not an options training log)")
        rows.append(row)
    if not rows:
        raise FileFormatError(f"{path}: no rows yet")
    return sorted(rows, key=lambda r: r["step"])


def running_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Mean of the last ``window`` values at each step (fewer at the start), Fig. 5's smoothing."""
    sums = np.cumsum(np.concatenate([[0.0], values]))
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    return (sums[ends] - sums[starts]) / (ends - starts)


def bootstrap_band(
    values: np.ndarray, window: int, resamples: int = RESAMPLES, seed: int = 0
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
    """``step`` and every curve of :data:`CURVES` as float arrays, one value per logged row."""
    out = {"step": np.array([r["step"] for r in rows], dtype=np.float64)}
    for key, _, get in CURVES:
        out[key] = np.array([get(r) for r in rows], dtype=np.float64)
    return out


def window_summary(values: np.ndarray, window: int, seed: int = 0) -> dict:
    """Mean of ``values`` and its bootstrap 95% interval (the last point of the band)."""
    low, high = bootstrap_band(values, window, seed=seed)
    return {"mean": float(values[-window:].mean()), "ci95": [float(low[-1]), float(high[-1])]}


def summarise(name: str, rows: list[dict], window: int) -> dict:
    """One run's summary: steps logged, last step, mean seconds per step, and per curve the mean
    (with its bootstrap 95% interval) of the first and the last ``window`` steps (``first_N`` /
    ``last_N``, N = ``window`` or the steps logged when fewer); the mean per-layer switch rate of
    the last window when the log has it."""
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
    """Draw Fig. 5 for ``runs`` (name → log rows) into the PNG ``path``: a column per curve, a colour
    per run; raw values faint, the running mean over ``window`` steps and its bootstrap 95% band.
    Written beside ``path`` and renamed into place; returns ``path``."""
    import matplotlib
    from matplotlib.figure import Figure  # not pyplot: the process's backend stays the user's

    fig = Figure(figsize=(4.6 * len(CURVES), 4.0))

    axes = fig.subplots(1, len(CURVES), squeeze=False)
    colours = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
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
    save_figure(fig, path, dpi=110)
    return path
