"""Load-balancing counts pooled over the last W optimiser steps (a global batch across time).

EMO A.1 computes f_i over the global batch so that load balancing spreads experts *across*
documents while the pool keeps them consistent *within* a document. Its global batch holds
thousands of documents; a CPU run's holds about eight (8 rows × 512 tokens), so f over one step
still forces the few documents in it to spread over all experts — the conflict A.1 describes.
Deviation: f_i = (this step's counts + the previous W steps' counts) / (their tokens). The past
counts are constants, as f already is (only P_i carries gradient), so the loss keeps its form and
scale; f spans ≈ (W + 1) × B rows of documents without a larger batch. ``lb_window = 0`` is EMO's
formula unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from moectl.errors import ConfigError


class CountWindow:
    """Ring buffer of per-layer expert counts [W, L, E] and token counts [W] (float64, CPU)."""

    def __init__(self, size: int, layers: int, experts: int) -> None:
        self.size = size
        self.counts = torch.zeros(size, layers, experts, dtype=torch.float64)
        self.tokens = torch.zeros(size, dtype=torch.float64)
        self.filled = 0  # steps pushed so far (the buffer holds min(filled, size) of them)

    def history(self) -> tuple[Tensor, Tensor]:
        """Counts [L, E] and tokens (0-dim) summed over the steps held (zeros before the first push)."""
        return self.counts.sum(0), self.tokens.sum()

    def push(self, counts: Tensor, tokens: Tensor | float) -> None:
        """Add one optimiser step's counts [L, E] (all ranks, all micro-batches), dropping the oldest."""
        if self.size == 0:
            return
        slot = self.filled % self.size
        self.counts[slot] = counts.detach().to("cpu", torch.float64)
        self.tokens[slot] = float(tokens)
        self.filled += 1

    def state_dict(self) -> dict[str, Any]:
        return {"counts": self.counts.clone(), "tokens": self.tokens.clone(), "filled": self.filled}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if tuple(state["counts"].shape) != tuple(self.counts.shape):
            raise ConfigError(
                f"load-balancing window of shape {tuple(state['counts'].shape)} in the checkpoint, "
                f"{tuple(self.counts.shape)} in this config"
            )
        self.counts.copy_(state["counts"])
        self.tokens.copy_(state["tokens"])
        self.filled = int(state["filled"])
