"""``moectl report results/*.json``: the papers' table layout, as Markdown and a PNG plot.

One row per run (model × routing), one column per benchmark, each cell ``value [low, high]``
(accuracies in %, perplexities as is), then the experts a mask allows and the switch rate in %
where a mask or controller was active (TE-MoE Table 2 / EMO Table 2 layout). The plot draws the
same numbers as grouped bars with 95% error bars, accuracies and perplexities on separate axes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moectl.eval.results import load_results
from moectl.io.atomic import save_figure


@dataclass
class Cell:
    value: float
    low: float | None
    high: float | None
    percent: bool

    def text(self) -> str:
        scale = 100.0 if self.percent else 1.0
        digits = 1 if self.percent else 2
        main = f"{self.value * scale:.{digits}f}"
        if self.low is None or self.high is None:
            return main
        return f"{main} [{self.low * scale:.{digits}f}, {self.high * scale:.{digits}f}]"


@dataclass
class Row:
    model: str
    routing: str
    experts: float | None
    cells: dict[str, Cell]
    switch: float | None


def _percent(metric_name: str) -> bool:
    return metric_name.split("[")[0] in ("acc", "acc_norm", "exact_match", "exact_match_flexible")


def build_rows(
    docs: Sequence[dict[str, Any]], tasks: Sequence[str] | None = None
) -> tuple[list[str], list[Row]]:
    """Columns (benchmarks, in first-seen order or as given) and one row per model × routing.

    Files of the same model label and routing label (e.g. benchmarks and perplexity run
    separately) merge into one row; a task present in several of them keeps the last file's value.
    """
    columns: list[str] = list(tasks) if tasks else []
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for doc in docs:
        routing = doc["routing"]
        key = (doc["model"].get("label") or doc["model"]["spec"], routing.get("label") or "full")
        acc = merged.setdefault(
            key, {"experts": routing.get("experts_allowed"), "cells": {}, "sw": 0.0, "n": 0}
        )
        for name, task in doc["tasks"].items():
            if tasks is None and name not in columns:
                columns.append(name)
            m = task["metrics"][task["primary"]]
            ci = m.get("ci95") or [None, None]
            acc["cells"][name] = Cell(m["value"], ci[0], ci[1], _percent(task["primary"]))
            sr = task.get("switch_rate")
            rate = policy_switch_rate(sr)
            if rate is not None and sr.get("sequences"):
                acc["sw"] += rate * sr["sequences"]
                acc["n"] += sr["sequences"]
    rows = [
        Row(model, routing, acc["experts"], acc["cells"], acc["sw"] / acc["n"] if acc["n"] else None)
        for (model, routing), acc in merged.items()
    ]
    return columns, rows


def _primary_names(docs: Sequence[dict[str, Any]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for doc in docs:
        for name, task in doc["tasks"].items():
            out.setdefault(name, task["primary"])
    return out


def markdown_table(docs: Sequence[dict[str, Any]], tasks: Sequence[str] | None = None) -> str:
    """The Markdown table of ``docs`` (model × benchmark with 95% CI, experts, switch %)."""
    columns, rows = build_rows(docs, tasks)
    primary = _primary_names(docs)
    show_experts = any(r.experts is not None for r in rows)
    show_switch = any(r.switch is not None for r in rows)
    header = ["model", "routing"]
    if show_experts:
        header.append("experts")
    header += [f"{c} ({primary.get(c, '?')}{', %' if _percent(primary.get(c, '')) else ''})" for c in columns]
    if show_switch:
        header.append("switch %")
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] * 2 + ["---:"] * (len(header) - 2)) + "|",
    ]
    for row in rows:
        cells = [row.model, row.routing]
        if show_experts:
            cells.append("all" if row.experts is None else f"{row.experts:g}")
        cells += [row.cells[c].text() if c in row.cells else "–" for c in columns]
        if show_switch:
            cells.append("–" if row.switch is None else f"{100 * row.switch:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Cells: value [95% interval] (Wilson for accuracies, bootstrap for perplexity).")
    return "\n".join(lines) + "\n"


def plot_results(
    docs: Sequence[dict[str, Any]], path: str | os.PathLike, tasks: Sequence[str] | None = None
) -> Path:
    """Grouped bars with 95% error bars: accuracies (%) on one axis, perplexities on another."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    columns, rows = build_rows(docs, tasks)
    primary = _primary_names(docs)
    groups = [
        ("accuracy (%)", [c for c in columns if _percent(primary.get(c, ""))]),
        ("perplexity", [c for c in columns if not _percent(primary.get(c, ""))]),
    ]
    groups = [(title, cols) for title, cols in groups if cols]
    widths = [max(3.0, 0.5 * len(cols) * (len(rows) + 1)) for _, cols in groups]
    fig, axes = plt.subplots(
        1, len(groups), figsize=(min(24.0, sum(widths) + 1.5), 4.5), squeeze=False, width_ratios=widths
    )
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
    plt.close(fig)
    return path


def report(
    paths: Sequence[str | os.PathLike],
    markdown: str | os.PathLike | None = None,
    plot: str | os.PathLike | None = None,
    tasks: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Read results files, write the Markdown table and the plot; return both and the rows."""
    if not paths:
        raise ValueError("no results files given")
    docs = [load_results(p) for p in paths]
    table = markdown_table(docs, tasks)
    out: dict[str, Any] = {"markdown": table, "files": [str(p) for p in paths]}
    if markdown is not None:
        Path(markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(markdown).write_text(table)
        out["markdown_path"] = str(markdown)
    if plot is not None:
        out["plot_path"] = str(plot_results(docs, plot, tasks))
    columns, rows = build_rows(docs, tasks)
    out["columns"] = columns
    out["rows"] = [
        {
            "model": r.model,
            "routing": r.routing,
            "experts": r.experts,
            "switch_rate": r.switch,
            "cells": {c: {"value": v.value, "ci95": [v.low, v.high]} for c, v in r.cells.items()},
            "text": {c: v.text() for c, v in r.cells.items()},
        }
        for r in rows
    ]
    return out


def policy_switch_rate(sr: dict | None) -> float | None:
    """The switch rate a reader means: the policy's own mask ω where it recorded one (a controller,
    a subset: ``allowed_mean``), else the router treated as an option policy (``mean``)."""
    if not sr:
        return None
    return sr["allowed_mean"] if sr.get("allowed_mean") is not None else sr.get("mean")
