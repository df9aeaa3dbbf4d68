"""Hit rate against budget, one line per policy, Belady's optimum dashed (a PNG)."""

from __future__ import annotations

from pathlib import Path

from moectl.io.atomic import atomic_path


def plot_hit_rate(rows: list[dict], path: str | Path, title: str) -> Path:
    """Write ``path`` (a .png; a folder gets ``hit_rate.png``) atomically from ``simulate.run``'s rows."""
    from matplotlib.figure import Figure  # not pyplot: the process's backend stays the user's

    from moectl.reporting.plots import wrap_title

    path = Path(path)
    if path.suffix.lower() != ".png":
        path = path / "hit_rate.png"
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    fig = Figure(figsize=(7.5, 4.6))
    ax = fig.subplots()
    for name in policies:
        points = sorted((r["budget"], r["hit_rate"]) for r in rows if r["policy"] == name)
        budgets, rates = zip(*points, strict=True)
        if name == "belady":
            ax.plot(budgets, rates, "k--", linewidth=2, label="belady (optimum)")
        else:
            ax.plot(budgets, rates, marker="o", markersize=4, linewidth=1.4, label=name)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # a budget is a whole number of experts
    ax.set_xlabel("budget: resident experts per MoE layer")
    ax.set_ylabel("hit rate (per token, layer, expert)")
    ax.set_title(wrap_title(title, 75), fontsize=10)  # the routing note a user wrote may be long
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png", bbox_inches="tight")
    return path
