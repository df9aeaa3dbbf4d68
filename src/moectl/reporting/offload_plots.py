"""``serve-offload --plot``'s figure: expert loads per forward step and which expert of which layer
was loaded (``server/offload_batch.py``)."""

from __future__ import annotations

from pathlib import Path

import torch

from moectl.io.atomic import save_figure


def plot_timeline(events, kinds: list[str], info, path: str | Path, title: str = "") -> Path:
    """PNG: expert loads per step (top) and which expert of which layer was loaded (bottom)."""
    from matplotlib.figure import Figure  # not pyplot: the process's backend stays the user's

    from moectl.reporting.plots import wrap_title

    path = Path(path)
    if path.suffix != ".png":
        path = path / "offload_timeline.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    steps = len(kinds)
    per_step = torch.zeros(steps + 1)
    for s, _, _ in events:
        per_step[s] += 1
    e = info.layers[0].num_experts
    fig = Figure(figsize=(10, 5))
    ax0, ax1 = fig.subplots(2, 1, sharex=True)
    ax0.bar(range(steps + 1), per_step.tolist(), width=1.0, color="tab:red")
    ax0.set_ylabel("expert loads")
    ax0.set_title(wrap_title(f"expert loads over forward steps ({title})", 90))  # a policy may name a path
    for s, kind in enumerate(kinds, 1):
        if kind == "prefill":
            ax0.axvline(s, color="grey", lw=0.5, ls=":")
    if events:
        ax1.scatter([s for s, _, _ in events], [layer * e + x for _, layer, x in events], s=4, marker="s")
    ax1.set_ylabel("MoE layer x experts + expert")
    ax1.set_xlabel("forward step (dotted: a prompt's prefill; a decoding step adds one token to each running prompt)")
    fig.tight_layout()
    save_figure(fig, path, dpi=100)
    return path
