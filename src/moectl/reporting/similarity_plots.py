"""EMO Figure 6's heatmaps: the domain similarity of expert use (``subsets/similarity.py``), one PNG
per MoE layer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor

from moectl.io.atomic import save_figure


def plot_similarity(
    similarity: Mapping[int, Tensor], domains: Sequence[str], out_dir: str | Path
) -> list[Path]:
    """One heatmap PNG per MoE layer (``similarity_layer{i}.png``); returns the paths.

    The colour scale spans the off-diagonal values of all layers (shared, so layers compare): on a
    fixed 0–1 scale, similarities of 0.91–1.00 were one colour. Cells carry their values."""
    import numpy as np
    from matplotlib.figure import Figure  # not pyplot: the process's backend stays the user's

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    off = [m[~torch.eye(len(domains), dtype=torch.bool)] for m in similarity.values()]
    low = float(torch.cat(off).min()) if off and len(domains) > 1 else 0.0
    high = float(torch.cat(off).max()) if off and len(domains) > 1 else 1.0
    low, high = (low, high) if high > low else (low - 0.01, high + 0.01)
    for index, matrix in sorted(similarity.items()):
        size = 1.5 + 0.45 * len(domains)
        fig = Figure(figsize=(size + 1, size))
        ax = fig.subplots()
        image = ax.imshow(matrix.numpy(), vmin=low, vmax=high, cmap="viridis")
        ax.set_xticks(range(len(domains)), domains, rotation=60, ha="right")
        ax.set_yticks(range(len(domains)), domains)
        if len(domains) <= 12:
            for (r, c), value in np.ndenumerate(matrix.numpy()):
                ax.text(
                    c,
                    r,
                    f"{value:.2f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="w" if value < low + 0.6 * (high - low) else "k",
                )
        ax.set_title(f"domain similarity of expert use, MoE layer {index}", fontsize=10)
        fig.colorbar(image, ax=ax, label=f"cosine (scale {low:.3f}-{high:.3f}, off-diagonal range)", extend="max")
        fig.tight_layout()
        path = out_dir / f"similarity_layer{index}.png"
        save_figure(fig, path, dpi=100)
        paths.append(path)
    return paths
