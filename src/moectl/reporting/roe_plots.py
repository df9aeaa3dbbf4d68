"""RoE figures: the per-layer tau heatmap (Appendix C, Figure 10) and the uniform-tau curve
(Appendix B, Figure 6), and the two together for ``roe tune``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from matplotlib.figure import Figure  # not pyplot: the process's backend stays the user's

from moectl.io.atomic import save_figure

if TYPE_CHECKING:
    from moectl.roe.tune import TuneResult


def plot_tau_heatmap(
    rows: Sequence[Sequence[float]],
    labels: Sequence[str],
    path: str | Path,
    max_tau: float,
    title: str = "Tuned Gumbel temperature per MoE layer",
) -> Path:
    """Figure 10 layout: one row per profile (here: the best trials, best first), one column per MoE layer."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n_layers = len(rows[0]) if rows else 0
    fig = Figure(figsize=(min(18, max(6.0, 2.5 + 0.45 * n_layers)), 1.4 + 0.38 * len(rows)))
    ax = fig.subplots()
    image = ax.imshow(
        rows, aspect="auto", cmap="viridis", vmin=0, vmax=max(max_tau, 1e-9), interpolation="nearest"
    )
    ax.set_xticks(range(n_layers))
    ax.set_xlabel("MoE layer")
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    if n_layers <= 24 and len(rows) <= 12:
        for r, row in enumerate(rows):
            for c, tau in enumerate(row):
                ax.text(
                    c,
                    r,
                    f"{tau:.2f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if tau < 0.6 * max_tau else "black",
                )
    fig.colorbar(image, ax=ax, label="tau")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    return path


def plot_uniform_curve(
    taus: Sequence[float],
    values: Sequence[float],
    path: str | Path,
    ylabel: str,
    title: str = "Uniform tau across MoE layers (RoE Appendix B)",
) -> Path:
    """Figure 6: the objective against one shared tau; tau = 0 is the plain model."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    order = sorted(range(len(taus)), key=lambda i: taus[i])
    xs, ys = [taus[i] for i in order], [values[i] for i in order]
    fig = Figure(figsize=(6, 3.8))
    ax = fig.subplots()
    ax.plot(xs, ys, marker="o")
    if xs and xs[0] == 0:
        ax.axhline(ys[0], color="grey", linestyle="--", linewidth=0.8, label="tau = 0 (plain model)")
        ax.legend(fontsize=8)
    ax.ticklabel_format(axis="y", useOffset=False)
    ax.set_xlabel("tau (all MoE layers)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    return path


def tune_figures(result: TuneResult, plot_dir: Path, max_tau: float, uniform: bool, direction: str) -> list[Path]:
    """``roe tune --plot-dir``'s figures: the best trials' tau per layer, and the uniform-tau curve."""
    ranked = sorted(result.history, key=lambda h: h["value"], reverse=direction == "maximize")[:10]
    label = "ppl" if result.objective == "ppl" else "acc"
    rows = [h["tau"] for h in ranked]
    labels = [f"#{h['trial']} {label}={h['value']:.6g}" for h in ranked]
    figures = [
        plot_tau_heatmap(
            rows, labels, plot_dir / "tau_heatmap.png", max_tau,
            title=f"Tuned tau per MoE layer (best {len(rows)} trials, best first)",
        )
    ]  # fmt: skip
    if uniform:
        taus = [h["tau"][0] for h in result.history]
        values = [h["value"] for h in result.history]
        ylabel = "validation perplexity" if result.objective == "ppl" else "validation accuracy"
        figures.append(plot_uniform_curve(taus, values, plot_dir / "uniform_tau.png", ylabel))
    return figures
