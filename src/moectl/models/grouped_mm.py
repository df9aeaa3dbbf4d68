"""Grouped matrix products over rows sorted by expert: what every experts forward of moectl runs.

Shared by the autocast-aware experts forward (``moectl.models.grouped_experts``), the expert LoRA branch
(``moectl.options.expert_lora``) and the offloaded experts over slots (``moectl.offload.slot_forward``):
:func:`group_by_expert` sorts a layer's (token, k) choices by expert, :func:`grouped_mm` runs the
products, :func:`combine` weights and sums each token's k outputs.

On the CPU, ``grouped_mm`` in bf16/fp16 runs one oneDNN matmul per group, and oneDNN compiles a
kernel for every new group size (≈ 0.3 ms each, cached by shape): a training step, whose group sizes
change every step, spent most of its expert time compiling (10–40 ms per call against 1–2 ms cached,
measured on an AMX CPU). ``group_by_expert(..., pad_to=P)`` rounds every group up to a multiple of P
zero rows, so the sizes repeat and the cache hits; :func:`cpu_pad` says when it pays.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from moectl.kernels import bf16_rows


@dataclass(frozen=True)
class Grouping:
    """A layer's T·k (token, expert) choices sorted by expert (stable: token order kept inside a group)."""

    order: Tensor  # [T·k] positions in the flattened [T, k] choices, sorted by expert
    rows: Tensor  # [T·k] the token of each sorted position
    offsets: Tensor  # [E] int32 end of each expert's group (cumulative counts), as grouped_mm takes
    counts: Tensor  # [E] rows per expert
    slots: Tensor | None = None  # [T·k] each sorted position's row in the padded layout (pad_to > 1)
    padded_rows: int = 0  # rows of the padded layout (pad_to > 1)
    padded_tokens: Tensor | None = None  # [padded rows] the token of each row; T (a zero row) for pads

    def gather(self, x: Tensor) -> Tensor:
        """The grouped rows of ``x`` [T, H]: [T·k, H], or the padded layout with zero pad rows.

        A row gather as ``F.embedding``: its backward on the CPU is ≈ 4× faster than indexing's
        (an ``index_put`` with accumulation), measured on a training step's [T·k, H] bf16 rows."""
        if self.padded_tokens is None:
            return F.embedding(self.rows, x)
        return F.embedding(self.padded_tokens, torch.cat([x, x.new_zeros(1, x.shape[-1])]))

    def row_experts(self) -> Tensor:
        """The group (expert) id of each grouped row, pad rows included: [T·k or padded rows]."""
        sizes = torch.diff(self.offsets, prepend=self.offsets.new_zeros(1))
        ids = torch.arange(sizes.numel(), device=sizes.device)
        return torch.repeat_interleave(ids, sizes, output_size=self.padded_rows or self.rows.numel())


def group_by_expert(index: Tensor, num_experts: int, pad_to: int = 1) -> Grouping:
    """``index`` [T, k] (expert or slot ids) grouped by id for :func:`grouped_mm`.

    ``pad_to`` > 1 rounds each group up to a multiple of ``pad_to`` rows (zeros in
    :meth:`Grouping.gather`, dropped in :func:`combine`): the offsets then describe the padded layout.
    """
    k = index.shape[-1]
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = expert_counts(flat, num_experts)
    if pad_to <= 1:
        return Grouping(order, order // k, counts.cumsum(0).to(torch.int32), counts)
    padded = (counts + pad_to - 1) // pad_to * pad_to
    shift = (padded.cumsum(0) - padded) - (counts.cumsum(0) - counts)  # padded start − start, per group
    slots = torch.arange(flat.numel(), device=flat.device) + shift[flat[order]]
    ends = padded.cumsum(0)
    total = int(ends[-1]) if num_experts else 0  # a host read: padding is for the CPU only
    tokens = torch.full((total,), index.shape[0], dtype=torch.long, device=flat.device)
    tokens[slots] = order // k
    return Grouping(order, order // k, ends.to(torch.int32), counts, slots, total, tokens)


def expert_counts(flat: Tensor, num_experts: int) -> Tensor:
    """Rows per id [num_experts] of ``flat`` ids. ``bincount`` on the CPU; elsewhere a scatter-add,
    since CUDA's ``bincount`` reads the largest id to size its output (a host sync, which a CUDA
    graph's capture refuses: ``moectl.lm.graph_decode``)."""
    if flat.device.type == "cpu":
        return torch.bincount(flat, minlength=num_experts)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    return counts.index_add_(0, flat, torch.ones_like(flat))


def cpu_pad(x: Tensor, dtype: torch.dtype, index: Tensor, num_experts: int) -> int:
    """The ``pad_to`` that keeps oneDNN's kernel cache warm for the (token, expert) choices ``index``
    [T, k] over ``x``'s device in ``dtype``: 32 for bf16/fp16 on the CPU when groups average ≥ 64 rows
    (padding adds ≤ 25%), else 1 (smaller batches, as in decoding, repeat their few sizes anyway;
    fp32 runs MKL)."""
    if x.device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return 1
    return 32 if index.numel() >= 64 * num_experts else 1


def combine(out: Tensor, weights: Tensor, grouping: Grouping, num_tokens: int) -> Tensor:
    """Σ_k w_k · out_k per token: ``out`` [T·k or padded rows, H] in grouped order, ``weights`` [T, k] → [T, H]."""
    w = weights.reshape(-1)[grouping.order]
    if grouping.padded_tokens is not None:  # pad rows weigh 0 and land on a dropped row T
        w = w.new_zeros(grouping.padded_rows).index_copy(0, grouping.slots, w)
        out = out * w.unsqueeze(-1).to(out.dtype)
        result = out.new_zeros(num_tokens + 1, out.shape[-1])
        return result.index_add_(0, grouping.padded_tokens, out)[:num_tokens]
    out = out * w.unsqueeze(-1).to(out.dtype)
    result = out.new_zeros(num_tokens, out.shape[-1])
    return result.index_add_(0, grouping.rows, out)


def grouped_mm(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """x [S, in] (rows sorted by expert) @ w[e] [in, out] per group; ``grouped_mm`` where it has a
    kernel (float32, bf16, fp16), else a loop over experts (float64, for exactness tests). bf16
    inference on the CPU runs ``moectl.kernels.bf16_rows.grouped`` (PyTorch's bf16 products there
    are far below the memory's speed; see that module) when ``w`` is a transposed [E, out, in]."""
    w_rows = w.transpose(-2, -1)
    if bf16_rows.applies(x, w_rows):
        return bf16_rows.grouped(x, w_rows, offsets)
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
