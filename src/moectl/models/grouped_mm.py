"""Grouped matrix products over rows sorted by expert: what every experts forward of moectl runs.

Shared by the training experts forward (``moectl.train.experts``), the expert LoRA branch
(``moectl.options.expert_lora``) and the offloaded experts over slots (``moectl.serve.slot_forward``):
:func:`group_by_expert` sorts a layer's (token, k) choices by expert, :func:`grouped_mm` runs the
products, :func:`combine` weights and sums each token's k outputs.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class Grouping:
    """A layer's T·k (token, expert) choices sorted by expert (stable: token order kept inside a group)."""

    order: Tensor  # [T·k] positions in the flattened [T, k] choices, sorted by expert
    rows: Tensor  # [T·k] the token of each sorted position
    offsets: Tensor  # [E] int32 end of each expert's group (cumulative counts), as grouped_mm takes
    counts: Tensor  # [E] rows per expert


def group_by_expert(index: Tensor, num_experts: int) -> Grouping:
    """``index`` [T, k] (expert or slot ids) grouped by id for :func:`grouped_mm`."""
    k = index.shape[-1]
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return Grouping(order, order // k, counts.cumsum(0).to(torch.int32), counts)


def combine(out: Tensor, weights: Tensor, grouping: Grouping, num_tokens: int) -> Tensor:
    """Σ_k w_k · out_k per token: ``out`` [T·k, H] in grouped order, ``weights`` [T, k] → [T, H]."""
    out = out * weights.reshape(-1)[grouping.order].unsqueeze(-1).to(out.dtype)
    result = out.new_zeros(num_tokens, out.shape[-1])
    return result.index_add_(0, grouping.rows, out)


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
