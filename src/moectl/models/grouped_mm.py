"""Grouped matrix products over rows sorted by expert: what every experts forward of moectl runs.

Shared by the training experts forward (``moectl.train.experts``) and the expert LoRA branch
(``moectl.options.expert_lora``).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import Tensor


def grouped_mm(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """x [S, in] (rows sorted by expert) @ w[e] [in, out] per group; ``grouped_mm`` where it has a
    kernel (float32, bf16, fp16), else a loop over experts (float64, for exactness tests)."""
    if x.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return F.grouped_mm(x, w, offs=offsets)
    bounds = [0, *offsets.tolist()]
    return torch.cat([x[a:b] @ w[e] for e, (a, b) in enumerate(itertools.pairwise(bounds))])


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype products run in: autocast's where it is on for ``x``'s device, else ``x``'s."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype
