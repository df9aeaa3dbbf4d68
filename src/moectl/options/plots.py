"""Training curves of options training (TE-MoE Fig. 5, A1, A2) as one PNG."""

from __future__ import annotations

from pathlib import Path

_PANELS = (
    ("reward", "reward (−reverse KL)"),
    ("switch_rate", "switch rate"),
    ("switch_prob_p95", "switch prob P95"),
    ("switch_prob_std", "switch prob std"),
    ("value_loss", "value loss"),
    ("repetition_rate", "repetition rate"),
    ("teacher_ppl", "teacher ppl of samples"),
)


def running_mean(values: list[float], window: int = 20) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_curves(log: list[dict], path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(16, 7))
    steps = [row["step"] for row in log]
    for ax, (key, label) in zip(axes.flat, _PANELS, strict=False):
        values = [row[key] for row in log]
        ax.plot(steps, values, alpha=0.3, color="tab:blue")
        ax.plot(steps, running_mean(values), color="tab:blue")
        ax.set_title(label)
        ax.set_xlabel("step")
    axes.flat[-1].axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_options(trace, path: str | Path, layer: int = 0, row: int = 0) -> Path:
    """TE-MoE Fig. 6: the option ω (shaded) and the activated experts (dark) over generated positions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if layer not in trace.allowed:
        raise ValueError(f"MoE layer {layer} has no recorded options; recorded: {sorted(trace.allowed)}")
    start = max(int(trace.prompt_len[row]) - 1, 0)
    valid = trace.valid[row]
    stop = int(valid.nonzero().max()) + 1 if bool(valid.any()) else start
    allowed = trace.allowed[layer][row, start:stop].T.float()
    chosen = trace.chosen_mask(layer)[row, start:stop].T.float()
    image = 0.35 * allowed + 0.65 * chosen
    fig, ax = plt.subplots(figsize=(min(16, 3 + image.shape[1] / 16), 2 + image.shape[0] / 12))
    ax.imshow(image.numpy(), aspect="auto", cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
    switches = (allowed[:, 1:] != allowed[:, :-1]).any(0).nonzero().flatten() + 1
    for s in switches.tolist():
        ax.axvline(s - 0.5, color="tab:red", lw=0.6, alpha=0.6)
    ax.set_xlabel("generated token position")
    ax.set_ylabel("expert")
    ax.set_title(f"options at MoE layer {layer} ({len(switches)} switches)")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
