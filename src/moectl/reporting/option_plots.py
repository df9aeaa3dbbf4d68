"""Training curves of options training (TE-MoE Fig. 5, A1, A2) as one PNG."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from moectl.io.atomic import save_figure
from moectl.reporting.option_curves import WINDOW, running_mean

_PANELS = (
    ("reward", "reward (−reverse KL)"),
    ("switch_rate", "switch rate"),
    ("switch_prob_p95", "switch prob P95"),
    ("switch_prob_std", "switch prob std"),
    ("value_loss", "value loss"),
    ("repetition_rate", "repetition rate"),
    ("teacher_ppl", "teacher ppl of samples"),
)



def plot_curves(log: list[dict], path: str | Path, title: str = "") -> Path:
    from matplotlib.figure import Figure  # not pyplot: the process's backend stays the user's

    fig = Figure(figsize=(16, 7))

    axes = fig.subplots(2, 4)
    steps = [row["step"] for row in log]
    for ax, (key, label) in zip(axes.flat, _PANELS, strict=False):
        values = [row[key] for row in log]
        ax.plot(steps, values, alpha=0.3, color="tab:blue")
        ax.plot(steps, running_mean(np.asarray(values, dtype=np.float64), WINDOW), color="tab:blue")
        ax.set_title(label)
        ax.set_xlabel("step")
    axes.flat[-1].axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    save_figure(fig, path, dpi=100)
    return path


def plot_options(
    trace, path: str | Path, layers: list[int] | None = None, row: int = 0, label: str | None = None,
    max_layers: int = 8, model: str | None = None,
) -> Path:
    """TE-MoE Fig. 6: the option ω (blue) and the activated experts (black) over the generated
    positions, one panel per MoE layer, each switch of ω a red line and counted in the panel's title.

    ``layers`` default: every recorded layer, or where there are more than ``max_layers``, the
    ``max_layers`` layers with the most switches (the figure's title says so). ``label``: the prompt;
    ``model``: the model's spec or path (its last two parts are shown). Constrained layout: the
    heading, the panels' titles and the legend (below the panels) never overlap nor leave the figure.
    """
    from matplotlib.figure import Figure  # not pyplot: the process's backend stays the user's
    from matplotlib.patches import Patch

    from moectl.reporting.plots import model_label, wrap_title

    start = max(int(trace.prompt_len[row]) - 1, 0)
    valid = trace.valid[row]
    stop = int(valid.nonzero().max()) + 1 if bool(valid.any()) else start
    recorded = sorted(trace.allowed)
    if not recorded:
        raise ValueError("the trace has no recorded options (route with a controller or a mask policy)")
    for layer in layers or []:
        if layer not in trace.allowed:
            raise ValueError(f"MoE layer {layer} has no recorded options; recorded: {recorded}")
    counts = {}
    for layer in recorded:
        allowed = trace.allowed[layer][row, start:stop]
        counts[layer] = int((allowed[1:] != allowed[:-1]).any(-1).sum())
    picked = layers or recorded
    note = ""
    if layers is None and len(recorded) > max_layers:
        picked = sorted(sorted(recorded, key=lambda layer: -counts[layer])[:max_layers])
        note = f" (the {max_layers} of {len(recorded)} MoE layers with the most switches)"
    n_exp = trace.allowed[picked[0]].shape[-1]
    n_pos = stop - start
    width = min(16.0, max(7.0, 4.5 + n_pos / 14))
    fig = Figure(figsize=(width, 1.6 + len(picked) * (0.6 + n_exp / 14)), layout="constrained")
    axes = fig.subplots(len(picked), 1, sharex=True, squeeze=False)
    for ax, layer in zip(axes[:, 0], picked, strict=True):
        allowed = trace.allowed[layer][row, start:stop].T
        chosen = trace.chosen_mask(layer)[row, start:stop].T
        image = torch.ones(n_exp, n_pos, 3)
        image[allowed] = torch.tensor([0.62, 0.78, 0.95])
        image[chosen] = 0.0
        ax.imshow(image.numpy(), aspect="auto", interpolation="nearest")
        switches = (allowed[:, 1:] != allowed[:, :-1]).any(0).nonzero().flatten() + 1
        for s in switches.tolist():
            ax.axvline(s - 0.5, color="crimson", lw=0.8)
        ax.set_ylabel("expert", fontsize=8)
        ax.set_title(f"MoE layer {layer}: {counts[layer]} switches", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("generated token position")
    chars = max(40, int(width * 12))
    heading = f"Options of the controller over {n_pos} generated tokens (TE-MoE Fig. 6){note}"
    if model:
        heading += f", {model_label(model)}"
    heading = wrap_title(heading, chars)
    if label:
        heading += "\n" + (label if len(label) <= chars else label[: chars - 3] + "...")
    fig.suptitle(heading, fontsize=10, x=0.01, ha="left")
    handles = [Patch(facecolor="black", label="activated"), Patch(facecolor=(0.62, 0.78, 0.95), label="option ω")]
    if any(counts[layer] for layer in picked):
        handles.append(Patch(facecolor="crimson", label="switch of ω"))
    fig.legend(handles=handles, loc="outside lower center", fontsize=8, frameon=False, ncols=len(handles))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path, dpi=110)
    return path
