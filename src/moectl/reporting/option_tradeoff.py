"""Switch rate against quality for TE-MoE controllers over η, beside the static prunings (one PNG).

TE-MoE Table 3 in a picture (issue 44 item 1): each controller of one k-hat is a point at its
switch rate (temperature 0.5, the paper's protocol) and its held-out per-token KL to the full
model, with 95% intervals both ways, joined in order of η; the four pruning baselines of the same
k-hat never switch (random re-draws every token: 100%) and the router at its own top-k is the
full model (KL 0) at its switch rate. The paper's 5-10% band is shaded. Rows are the ``rows`` of
``benchmarks/options_headline.py``'s JSON files; the same row in several files (the baselines,
computed alike in each run) is drawn once.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from moectl.io.atomic import save_figure

_ETA = re.compile(r"η\s*=\s*([0-9.]+)")


def tradeoff_rows(files: list[dict[str, Any]], k_hat: int) -> dict[str, Any]:
    """{"controllers": [...sorted by η], "baselines": [...], "router": row or None} for ``k_hat``;
    each item {method, eta?, kl, kl_ci95, switch, switch_ci95, step?} (switch rates as fractions)."""
    controllers: dict[float, dict] = {}
    baselines: dict[str, dict] = {}
    router = None
    for data in files:
        for row in data.get("rows", []):
            if row.get("k_hat") != k_hat:
                continue
            item = {
                "method": row["method"], "kl": row["kl"], "kl_ci95": row.get("kl_ci95", 0.0),
                "switch": row["switch_rate"], "switch_ci95": row.get("switch_rate_ci95", 0.0),
            }  # fmt: skip
            match = _ETA.search(row["method"])
            if row["method"].startswith("controller") and match:
                item["eta"] = float(match.group(1))
                item["step"] = row.get("train_step")
                controllers[item["eta"]] = item
            elif row["method"] == "base model":
                router = item
            else:
                baselines.setdefault(row["method"], item)
    return {"controllers": [controllers[e] for e in sorted(controllers)], "baselines": list(baselines.values()),
            "router": router}  # fmt: skip


def plot_tradeoff(rows: dict[str, Any], k_hat: int, path: str | Path, title: str = "") -> Path:
    """The figure of :func:`tradeoff_rows`' points (see the module doc)."""
    from matplotlib.figure import Figure  # not pyplot: the process's backend stays the user's

    fig = Figure(figsize=(10.5, 5.5))
    ax = fig.subplots()
    ax.axvspan(5, 10, color="tab:green", alpha=0.12, label="the paper's 5–10% (Table 3)")
    ctrl = rows["controllers"]
    if ctrl:
        xs = [100 * c["switch"] for c in ctrl]
        ys = [c["kl"] for c in ctrl]
        ax.errorbar(xs, ys, xerr=[100 * c["switch_ci95"] for c in ctrl], yerr=[c["kl_ci95"] for c in ctrl],
                    fmt="o-", color="tab:blue", capsize=3, label=f"controllers, k̂ = {k_hat}")  # fmt: skip
        for c, x, y in zip(ctrl, xs, ys, strict=True):
            step = f", step {c['step']}" if c.get("step") else ""
            ax.annotate(f"η = {c['eta']:g}{step}", (x, y), textcoords="offset points", xytext=(6, 6), fontsize=8)
    styles = iter(zip(("s", "D", "^", "v", "P", "X"), ("tab:purple", "tab:orange", "tab:green", "tab:red",
                                                          "tab:brown", "tab:olive"), strict=True))  # fmt: skip
    static = [b for b in rows["baselines"] if b["switch"] == 0]
    for b in rows["baselines"]:  # static ones side by side around 0 (they all never switch)
        x = 100 * b["switch"] + (static.index(b) - (len(static) - 1) / 2 if b in static else 0.0)
        marker, color = next(styles, ("o", "gray"))
        ax.errorbar([x], [b["kl"]], yerr=[b["kl_ci95"]], fmt=marker, color=color, capsize=3,
                    label=f"{b['method']} (static: 0%)" if b in static else f"{b['method']} (re-drawn per token)")  # fmt: skip
    if rows["router"] is not None:
        r = rows["router"]
        ax.errorbar([100 * r["switch"]], [0.0], xerr=[100 * r["switch_ci95"]], fmt="*", markersize=12,
                    color="black", label=f"router, top-{k_hat} of its own (the full model)")  # fmt: skip
    ax.set_xlabel("switch rate, % of tokens (temperature 0.5)")
    ax.set_ylabel("per-token KL(full ‖ pruned), held-out documents")
    ax.set_xlim(-3, 103)
    ax.set_ylim(bottom=-0.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title(title or f"TE-MoE controllers over η against static pruning, k̂ = {k_hat}")
    fig.tight_layout()
    return save_figure(fig, path)
