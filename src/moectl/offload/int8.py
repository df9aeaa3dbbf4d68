"""int8 weight-only resident slots: half the bytes of bf16 per resident expert, read at twice the speed.

Issue 18 (kernels that read at memory speed): a decode step is bound by the bytes of expert
weights it reads. ``benchmarks/decode_kernels.py`` measured, on OLMoE's expert shapes, bf16
``F.linear`` / ``grouped_mm`` at ≈ 27 GB/s and PyTorch's int8 weight-only kernel
(``aten._weight_int8pack_mm``: int8 weights, one scale per output row, bf16 activations) at
≈ 31 GB/s of int8 read = 62 GB/s bf16-equivalent, 2.28× bf16 (2 threads). With ``slot_dtype="int8"``
the offloading runtime keeps each resident expert's 3-D weights as int8 plus one scale per output
row (symmetric absmax, round to nearest), quantised when the expert is loaded; the checkpoint
and the store keep the original weights, so leaving the block restores them exactly.

Deviation: not exact — a weight's error is at most half a step (absmax/254 of its row); the
effect on logits and perplexity is measured by ``benchmarks/int8_slots.py``, not assumed.

The kernel is used where it is known to be right: on the CPU, with 2-D contiguous activations,
K (the reduction width) a multiple of 16 — with other K this PyTorch 2.13 CPU kernel returns
garbage or crashes (measured: K = 8, 24, 33, 36, 40) — and few rows (decode; a long prefill
multiplies the dequantised weight instead, where a GEMM is compute-bound anyway). Elsewhere
(CUDA, other widths) the weight is dequantised for the product: the memory saving stays, the
read speed-up does not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from moectl.errors import ConfigError
from moectl.kernels import int8_rows, unpack

SLOT_DTYPES = ("same", "int8")
SCALE = "_scale"  # slot name suffix of a quantised weight's per-row scales
KERNEL_MAX_ROWS = 16  # rows (tokens) up to which the int8 kernel beats a dequantised GEMM
UNPACK_MIN_ROWS = 16
"""bf16 rows from which the weight is dequantised by ``moectl.kernels.unpack`` and multiplied by
PyTorch's bf16 product instead of moectl's int8 kernel. Quiet, 2 threads, medians of 5, kernel
against dequantised ms for [2048, 2048] / [2048, 1024] / [1024, 2048]: 12 rows 0.45 / 0.58, 0.23 /
0.31, 0.23 / 0.29; 16 rows 0.58 / 0.62, 0.31 / 0.30, 0.30 / 0.29; 20 rows 0.76 / 0.60, 0.39 / 0.31,
0.36 / 0.30: they cross at about 16."""


def quantized(t: Tensor) -> bool:
    """Whether a [E, ...] expert parameter is quantised in int8 slots: weights (≥ 2 dims per expert),
    not biases."""
    return t.dim() >= 3


def quantize_rows(w: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per output row: ``w ≈ q * scale[..., None]``; ``q`` int8 of ``w``'s shape,
    ``scale`` float32 with one value per row (the last dimension is reduced over).

    The scale stays float32 whatever ``w``'s dtype: absmax/127 of an fp16 row of small weights
    (below ~7.6e-6) underflows fp16 to 0 and the row would dequantise to zeros."""
    w32 = w.float()
    scale = w32.abs().amax(-1).clamp_min(torch.finfo(torch.float32).tiny) / 127
    q = (w32 / scale.unsqueeze(-1)).round_().clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_rows(q: Tensor, scale: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """``q * scale`` per row, computed in the scale's dtype, returned in ``dtype`` (default: it)."""
    out = q.to(scale.dtype) * scale.unsqueeze(-1)
    return out if dtype is None else out.to(dtype)


def int8_linear(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """``x @ (q * scale).T`` for x [M, K], q [N, K] int8, scale [N] float32 (``quantize_rows``).

    On the CPU, bf16 rows from ``UNPACK_MIN_ROWS`` on: the weight dequantised by moectl's C loop
    (``moectl.kernels.unpack``) and PyTorch's bf16 product. Fewer rows, up to a few dozen:
    moectl's own kernel (``moectl.kernels.int8_rows``: fp32
    sums, float32 scales, any K; 1.5-1.7x PyTorch's at 1 and 8 rows). Else PyTorch's, which takes the
    scales in x's dtype; where that cast would flush a scale to 0 (fp16's range), the product is
    taken with the weight dequantised in float32 and cast instead."""
    if x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] >= UNPACK_MIN_ROWS and unpack.int8_applies(q, scale):
        return F.linear(x, unpack.int8_unpacked(q, scale))  # dequantised in C, PyTorch's bf16 product
    if int8_rows.applies(x, q):
        return int8_rows.linear(x, q, scale)
    fast = (
        x.device.type == "cpu"
        and x.dim() == 2
        and x.shape[0] <= KERNEL_MAX_ROWS
        and x.shape[1] % 16 == 0
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
    )
    if fast:
        scale_x = scale.to(x.dtype)
        if x.dtype != torch.float16 or not bool(((scale_x == 0) & (scale != 0)).any()):
            return torch.ops.aten._weight_int8pack_mm(x.contiguous(), q.contiguous(), scale_x.contiguous())
    return F.linear(x, dequantize_rows(q, scale, x.dtype))


def slot_templates(params: dict[str, Tensor], slot_dtype: str) -> dict[str, Tensor]:
    """What a resident slot holds per expert parameter, as meta tensors [E, ...]: the parameter
    itself (``"same"``), or for ``"int8"`` each weight as int8 plus its float32 ``NAME_scale`` [E, rows]."""
    if slot_dtype not in SLOT_DTYPES:
        raise ConfigError(f"slot dtype must be one of {', '.join(SLOT_DTYPES)}, got {slot_dtype!r}")
    out: dict[str, Tensor] = {}
    for name, p in params.items():
        if slot_dtype == "int8" and quantized(p):
            out[name] = torch.empty(p.shape, dtype=torch.int8, device="meta")
            out[name + SCALE] = torch.empty(p.shape[:-1], dtype=torch.float32, device="meta")
        else:
            out[name] = torch.empty(p.shape, dtype=p.dtype, device="meta")
    return out


def expert_slot_bytes(params: dict[str, Tensor] | list[Tensor], slot_dtype: str) -> int:
    """Bytes one resident expert takes in slots of ``slot_dtype`` (``params``: [E, ...] tensors)."""
    items = params if isinstance(params, dict) else {str(i): p for i, p in enumerate(params)}
    return sum(t[0].numel() * t.element_size() for t in slot_templates(items, slot_dtype).values())


class QuantizingStore:
    """An expert store whose ``load`` returns the int8 slot form of the ``inner`` store's experts
    (the names of ``slot_templates``). ``inner`` stays the source of truth for restoring."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def load(self, layer: int, expert: int) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for name, w in self.inner.load(layer, expert).items():
            if w.dim() >= 2:
                out[name], out[name + SCALE] = quantize_rows(w)
            else:
                out[name] = w
        return out
