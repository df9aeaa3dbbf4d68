"""Figures the papers draw, from a RoutingTrace, written as PNG files."""

from __future__ import annotations

from pathlib import Path

import torch
from matplotlib.figure import Figure  # not pyplot: the process's backend stays the user's

from moectl.errors import ConfigError
from moectl.io.atomic import save_figure
from moectl.metrics.switch_rate import router_option_masks
from moectl.routing.trace import RoutingTrace


def model_label(spec: str | Path) -> str:
    """How a figure names a model: the last two parts of a path (``/data/runs/olmoe-math/final`` →
    ``olmoe-math/final``); a hub id (``allenai/OLMoE-1B-7B-0924``) or ``tiny:olmoe`` as given."""
    parts = [part for part in str(spec).replace("\\", "/").split("/") if part not in ("", ".")]
    return "/".join(parts[-2:]) if parts else str(spec)


def wrap_title(text: str, width: int = 80) -> str:
    """``text`` in lines of at most ``width`` characters, broken at spaces or, inside a word longer
    than a line (a path), after a ``/``: never in the middle of a name. A piece with no break in it
    longer than ``width`` keeps its own line whole."""
    lines = []
    for paragraph in text.split("\n"):
        pieces: list[tuple[str, str]] = []  # (piece, what joins it to the previous piece)
        for i, word in enumerate(paragraph.split(" ")):
            parts = [word] if len(word) <= width else [p for p in word.replace("/", "/\0").split("\0") if p]
            pieces += [(part, " " if i and j == 0 else "") for j, part in enumerate(parts or [""])]
        line = ""
        for piece, sep in pieces:
            if line and len(line) + len(sep) + len(piece) > width:
                lines.append(line.rstrip())
                line = piece
            else:
                line = line + sep + piece if line else piece
        lines.append(line.rstrip())
    return "\n".join(lines)


def plot_expert_activation(
    trace: RoutingTrace,
    path: str | Path,
    layer: int = 0,
    row: int = 0,
    k_hat: int | None = None,
    title: str | None = None,
    label: str | None = None,
    model: str | None = None,
) -> Path:
    """TE-MoE Figure 2: experts activated at one layer over the generated token positions.

    Black cells are the activated experts. The option ω (TE-MoE §2.2) is drawn in blue behind them
    and every switch of ω is a red tick in the strip above, the subtitle giving the number of
    switches and the switch rate. ω is the mask a policy recorded at this layer (a controller's
    option, a document pool, a subset) when the trace holds one and no ``k_hat`` is given; else the
    router treated as an option with ``k_hat`` experts (default: top-k). Where ω never shows beyond
    the activated experts (k-hat = top-k) the legend says so in one entry. ``label`` (e.g. the
    prompt and its category; default: which sequence of the trace) is printed under the title,
    ``model`` (a spec or path; its last two parts) in it.
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
    fig = Figure(figsize=(width, 2.6 + n_exp / 10))
    strip, ax = fig.subplots(2, 1, sharex=True, height_ratios=[1, max(3.0, n_exp / 4)])
    image = torch.ones(n_exp, n_pos, 3)  # white
    handles = [Patch(facecolor="black", label="activated")]
    subtitle = [label if label else f"sequence {row} of the trace"]
    if k_hat is None and layer in trace.allowed:
        option = trace.allowed[layer][row, start:stop]
        sizes = option.sum(-1).unique().tolist()
        what = "ω recorded by the policy" + (f" (k-hat = {sizes[0]})" if len(sizes) == 1 else "")
        legend = "option ω (recorded mask)"
    else:
        k_hat = trace.top_k if k_hat is None else k_hat
        probs = trace.probs[layer][row : row + 1, start:stop]
        option = router_option_masks(probs, activated[None], k_hat)[0]
        what = f"k-hat = {k_hat}"
        legend = f"option ω (router, top k-hat={k_hat})"
    image[option.T] = torch.tensor([0.62, 0.78, 0.95])  # the option ω: light blue
    switches = (option[1:] != option[:-1]).any(-1).nonzero().flatten() + 1
    strip.vlines(switches.tolist(), 0, 1, color="crimson", linewidth=1.0)
    if not len(switches):  # say so rather than leave a blank strip
        strip.text(0.5, 0.5, "ω never switches", transform=strip.transAxes, ha="center", va="center", fontsize=8)
    if bool((option & ~activated).any()):  # ω shows beyond the activated experts
        handles.append(Patch(facecolor=(0.62, 0.78, 0.95), label=legend))
    else:  # no blue cell anywhere: one entry, not a second black one
        handles[0] = Patch(facecolor="black", label=f"activated = option ω ({what})")
    if len(switches):
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
    heading = title or f"Activated experts, MoE layer {layer} (TE-MoE Fig. 2)" + (
        f", {model_label(model)}" if model else ""
    )
    text = wrap_title(heading, max(40, int(width * 11))) + "\n" + "\n".join(subtitle)
    strip.set_title(text, fontsize=9, loc="left")
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    save_figure(fig, path, dpi=120, bbox_inches="tight")
    return path


def plot_switch_rate_per_layer(
    per_layer: dict[str, list[float]], path: str | Path, title: str = "Switch rate per MoE layer"
) -> Path:
    """Switch rate against MoE layer, one line per label (e.g. prompt category); the legend beside
    the axes, never over a line. ``title`` should name the model and k-hat (or the recorded ω)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    n_layers = 0
    for label, values in per_layer.items():
        ax.plot(range(len(values)), values, marker="o", label=label)
        n_layers = max(n_layers, len(values))
    ax.set_xticks(range(0, n_layers, max(1, n_layers // 16)))  # whole layers, never 0.25
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("switch rate")
    ax.set_ylim(-0.03, 1.05)  # a layer that never switches shows its point, not half of it
    ax.set_title(wrap_title(title, 70), fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    save_figure(fig, path, dpi=120, bbox_inches="tight")
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

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
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
    return path
