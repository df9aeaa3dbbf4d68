"""``moectl report``'s figure: the results table (``eval/report.py``) as grouped bars with 95% error
bars, accuracies (%) and perplexities on separate axes."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moectl.eval.report import build_rows, percent_columns
from moectl.io.atomic import save_figure


def plot_results(
    docs: Sequence[dict[str, Any]], path: str | os.PathLike, tasks: Sequence[str] | None = None
) -> Path:
    """Grouped bars with 95% error bars: accuracies (%) on one axis, perplexities on another."""
    import numpy as np
    from matplotlib.figure import Figure  # not pyplot: the process's backend stays the user's

    columns, rows = build_rows(docs, tasks)
    percent = percent_columns(docs, columns)
    groups = [
        ("accuracy (%)", [c for c in columns if c in percent]),
        ("perplexity", [c for c in columns if c not in percent]),
    ]
    groups = [(title, cols) for title, cols in groups if cols]
    widths = [max(3.0, 0.5 * len(cols) * (len(rows) + 1)) for _, cols in groups]
    fig = Figure(figsize=(min(24.0, sum(widths) + 1.5), 4.5))
    axes = fig.subplots(1, len(groups), squeeze=False, width_ratios=widths)
    width = 0.8 / max(1, len(rows))
    for ax, (title, cols) in zip(axes[0], groups, strict=True):
        x = np.arange(len(cols))
        for r, row in enumerate(rows):
            values, err = [], [[], []]
            for c in cols:
                cell = row.cells.get(c)
                scale = 100.0 if cell is not None and cell.percent else 1.0
                v = np.nan if cell is None else cell.value * scale
                values.append(v)
                lo = v if cell is None or cell.low is None else cell.low * scale
                hi = v if cell is None or cell.high is None else cell.high * scale
                err[0].append(max(0.0, v - lo) if cell else 0.0)
                err[1].append(max(0.0, hi - v) if cell else 0.0)
            label = f"{row.model} · {row.routing}"
            if row.switch is not None:
                label += f" (switch {100 * row.switch:.0f}%)"
            ax.bar(x + (r - (len(rows) - 1) / 2) * width, values, width, yerr=err, capsize=3, label=label)
        ax.set_xticks(x)
        ax.set_xticklabels(cols, rotation=30, ha="right")
        ax.set_ylabel(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="best")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path, dpi=120)
    return path
