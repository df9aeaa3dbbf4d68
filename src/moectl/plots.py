"""Figures the papers draw, from a RoutingTrace, written as PNG files."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from moectl.errors import ConfigError
from moectl.fileio import save_figure
from moectl.metrics.switch_rate import router_option_masks
from moectl.routing.trace import RoutingTrace


def plot_expert_activation(
    trace: RoutingTrace,
    path: str | Path,
    layer: int = 0,
    row: int = 0,
    k_hat: int | None = None,
    title: str | None = None,
    label: str | None = None,
) -> Path:
    """TE-MoE Figure 2: experts activated at one layer over the generated token positions.

    Black cells are the activated experts. The option ω (TE-MoE §2.2) is drawn in blue behind them
    and every switch of ω is a red tick in the strip above, the subtitle giving the number of
    switches and the switch rate: with ``k_hat`` ω is the router treated as an option with k-hat
    experts; without it, ω is the mask a policy recorded at this layer (a controller's option, a
    subset), when the trace holds one. ``label`` (e.g. the prompt or its category; default: which
    sequence of the trace) is printed under the title.
    """
    from matplotlib.patches import Patch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if layer not in trace.chosen:
        raise ConfigError(f"MoE layer {layer} is not in the trace; recorded layers: {sorted(trace.chosen)}")
    if not 0 <= row < trace.valid.shape[0]:
        raise ConfigError(f"row {row} out of range; the trace has {trace.valid.shape[0]} sequences")
    start = max(int(trace.prompt_len[row]) - 1, 0)
    valid = trace.valid[row]
    stop = int(valid.nonzero().max()) + 1 if bool(valid.any()) else start
    activated = trace.chosen_mask(layer)[row, start:stop]  # [T, E]
    chosen = activated.T.float()  # [E, T]
    n_exp, n_pos = chosen.shape
    width = min(16.0, 4.5 + n_pos / 14)
    fig, (strip, ax) = plt.subplots(
        2, 1, sharex=True, figsize=(width, 2.6 + n_exp / 10), height_ratios=[1, max(3.0, n_exp / 4)]
    )
    image = torch.ones(n_exp, n_pos, 3)  # white
    handles = [Patch(facecolor="black", label="activated")]
    subtitle = [label if label else f"sequence {row} of the trace"]
    option, what = None, ""
    if k_hat is not None:
        probs = trace.probs[layer][row : row + 1, start:stop]
        option = router_option_masks(probs, activated[None], k_hat)[0]
        what = f"k-hat = {k_hat}"
        legend = f"option ω (router, top k-hat={k_hat})"
    elif layer in trace.allowed:
        option = trace.allowed[layer][row, start:stop]
        what = "ω recorded by the policy"
        legend = "option ω (recorded mask)"
    if option is not None:
        image[option.T] = torch.tensor([0.62, 0.78, 0.95])  # the option ω: light blue
        switches = (option[1:] != option[:-1]).any(-1).nonzero().flatten() + 1
        strip.vlines(switches.tolist(), 0, 1, color="crimson", linewidth=1.0)
        if bool((option & ~activated).any()):  # ω shows beyond the activated experts
            handles.append(Patch(facecolor=(0.62, 0.78, 0.95), label=legend))
        else:
            handles.append(Patch(facecolor="black", label="ω = the activated experts"))
        handles.append(Patch(facecolor="crimson", label="switch of ω"))
        rate = len(switches) / max(n_pos - 1, 1)
        subtitle.append(f"{what}: {len(switches)} switches in {n_pos} tokens (switch rate {rate:.0%})")
    image[chosen.bool()] = 0.0
    ax.imshow(image.numpy(), aspect="auto", interpolation="nearest")
    strip.set_ylim(0, 1)
    strip.set_yticks([])
    strip.set_ylabel("switch", rotation=0, ha="right", va="center", fontsize=8)
    for side in ("top", "right", "left"):
        strip.spines[side].set_visible(False)
    ax.set_xlabel("generated token position")
    ax.set_ylabel("expert")
    if n_exp <= 32:
        ax.set_yticks(range(n_exp))
        ax.tick_params(axis="y", labelsize=7 if n_exp > 16 else 9)
    subtitle[0] = subtitle[0] if len(subtitle[0]) <= 70 else subtitle[0][:67] + "..."
    heading = title or f"Activated experts, MoE layer {layer} (TE-MoE Fig. 2)"
    strip.set_title(heading + "\n" + "\n".join(subtitle), fontsize=9, loc="left")
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    save_figure(fig, path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_switch_rate_per_layer(
    per_layer: dict[str, list[float]], path: str | Path, title: str = "Switch rate per MoE layer"
) -> Path:
    """Switch rate against MoE layer, one line per label (e.g. prompt category)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, values in per_layer.items():
        ax.plot(range(len(values)), values, marker="o", label=label)
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("switch rate")
    ax.set_ylim(0, 1.05)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
    return path


def _si(value: float, _pos: int | None = None) -> str:
    """1500000 → 1.5M, 250000 → 250k, 12 → 12."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.4g}{suffix}"
    return f"{value:.4g}"


def plot_curves(
    series: dict[str, tuple[list[float], list[float]]],
    path: str | Path,
    xlabel: str,
    ylabel: str = "loss",
    title: str | None = None,
) -> Path:
    """Line plot of named (x, y) series (a loss curve); one marker per point for short series.
    Large x values (tokens) are labelled 1.5M / 250k rather than 1500000."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o" if len(xs) <= 30 else None, markersize=3, label=label)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=8, integer=True))
    ax.xaxis.set_major_formatter(FuncFormatter(_si))
    ax.grid(alpha=0.3)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path
