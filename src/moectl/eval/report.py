"""``moectl report results/*.json``: the papers' table layout, as Markdown and a PNG plot.

One row per run (model × routing), one column per benchmark, each cell ``value [low, high]``
(accuracies in %, perplexities as is), then the experts a mask allows and the switch rate in %
where a mask or controller was active (TE-MoE Table 2 / EMO Table 2 layout). The plot draws the
same numbers as grouped bars with 95% error bars, accuracies and perplexities on separate axes (``reporting/eval_plots.py``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moectl.errors import ConfigError
from moectl.eval.results import load_results


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


def percent_columns(docs: Sequence[dict[str, Any]], columns: Sequence[str]) -> set[str]:
    """The columns whose primary metric (as the first file naming the task records it) is a percentage."""
    primary = _primary_names(docs)
    return {c for c in columns if _percent(primary.get(c, ""))}


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


def report(
    paths: Sequence[str | os.PathLike],
    markdown: str | os.PathLike | None = None,
    plot: str | os.PathLike | None = None,
    tasks: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Read results files, write the Markdown table and the plot; return both and the rows."""
    if not paths:
        raise ConfigError("no results files given")
    docs = [load_results(p) for p in paths]
    table = markdown_table(docs, tasks)
    out: dict[str, Any] = {"markdown": table, "files": [str(p) for p in paths]}
    if markdown is not None:
        Path(markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(markdown).write_text(table)
        out["markdown_path"] = str(markdown)
    if plot is not None:
        from moectl.reporting.eval_plots import plot_results  # matplotlib only when plotting

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
