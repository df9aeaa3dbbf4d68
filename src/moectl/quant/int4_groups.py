"""int4 weight-only products, group-wise, through PyTorch's CPU kernel (issue 40: "PyTorch's kernels first").

Issue 40 measured ``aten._weight_int4pack_mm_for_cpu`` (the kernel torchao builds on) reading a
decode row's weights ~2.4x faster than bf16. Its format, which this module follows rather than
re-implements:

- weights ``q`` in 0..15, one byte per two, packed by ``aten._convert_weight_to_int4pack_for_cpu``
  ([N, K] int32 -> [N, K/2] uint8 in a blocked layout of its own);
- per group of ``g`` consecutive inputs of an output row a scale ``s`` and a "zero" ``z`` in the
  activations' dtype, ``qScaleAndZeros`` [K/g, N, 2], with ``w = (q - 8) * s + z``: asymmetric, the
  group's minimum and maximum both on the grid (``s = (max - min) / 15``, ``z = min + 8 s``);
- N a multiple of 16, K a multiple of g, g one of 32, 64, 128, 256 (checked by the kernel).

Shapes outside that are padded, not refused: output rows up to a multiple of 16 (dropped from the
product) and inputs up to a multiple of the group (zero weights times zero activations). A tensor's
group is the requested one where it divides K, else the largest allowed one that does (the
reference model's 128-wide down projection at a requested 256: 128).

Many rows (a prefill) are multiplied with the weight dequantised instead: the kernel's time grows
with the rows, a dequantised GEMM's does not. bf16 rows from ``INT4_UNPACK_MIN_ROWS`` on take moectl's
C dequantisation (``moectl.kernels.unpack``, 17x faster than :func:`dequantize`; a prefill of 128
tokens at OLMoE-1B-7B's width 2.0x faster, ``benchmarks/quant_prefill.py``); elsewhere
:func:`dequantize` past ``INT4_KERNEL_MAX_ROWS``.
Dequantising reads the kernel's packed layout, which PyTorch does not document; :func:`layout_known`
checks the reading against the packing op on this machine for each shape, and where it does not
match the product stays on the kernel for any number of rows and :func:`dequantize` asks the kernel
itself (an identity product), so a different layout is slower, never wrong.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor

from moectl.kernels import bf16_rows, int4_row, unpack
from moectl.quant.quant_config import GROUP_SIZES

ROW_ALIGN = 16  # the kernel's N must be a multiple of this
INT4_KERNEL_MAX_ROWS = 80
"""Rows up to which the int4 kernel runs; past it the weight is dequantised for a GEMM. The kernel's
time grows with the rows, a dequantisation and a bf16 GEMM barely do: [2048, 2048], group 128, one
thread, kernel / dequantised ms at 64 rows 9.33 / 10.89, at 96 rows 12.51 / 11.84 (an earlier run:
5.65 / 7.98 and 8.43 / 7.88; ``crossover`` in ``benchmarks/quantized_experts.py``): they cross
between 64 and 96 rows. A decode step is far below it;
a prefill of a few hundred tokens reaches it."""


INT4_UNPACK_MIN_ROWS = 24
"""bf16 rows from which the weight is dequantised by ``moectl.kernels.unpack`` (17x faster than
:func:`dequantize`: 0.35 against 6.0 ms for [2048, 2048], 2 threads) and multiplied by PyTorch's bf16
product. Quiet, 2 threads, group 64, medians of 5, kernel against dequantised ms for [2048, 2048] /
[2048, 1024] / [1024, 2048]: 16 rows 0.74 / 0.85, 0.37 / 0.45, 0.37 / 0.46; 20 rows 0.92 / 0.88,
0.45 / 0.43, 0.45 / 0.48; 24 rows 1.09 / 0.84, 0.55 / 0.43, 0.55 / 0.48: they cross at about 20,
where a 20-token prefill of the OLMoE-dims model measured 0.94x with the threshold at 20 (each
dequantised weight is a new 8 MB allocation), so it starts at 24. Decoding steps stay far below it;
a prefill's projections and its busier experts pass it."""


def group_for(k: int, group_size: int) -> int:
    """The group a [N, k] weight is quantised in: ``group_size`` if it divides ``k``, else the largest
    allowed group below it that does, else the smallest allowed group (``k`` is then padded)."""
    fits = [g for g in GROUP_SIZES if g <= group_size and k % g == 0]
    return max(fits) if fits else GROUP_SIZES[0]


def _ceil(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def quantize(w: Tensor, group_size: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, int]:
    """``(packed, scale_zero, group)`` of a [N, K] weight: ``packed`` [N', K'/2] uint8 for the kernel,
    ``scale_zero`` [K'/group, N', 2] in ``dtype`` (the activations' dtype the kernel takes), with N'
    and K' the padded sizes. The codes are rounded against the scale and zero as stored in ``dtype``,
    so the weight the kernel multiplies is the nearest this format holds."""
    n, k = w.shape
    group = group_for(k, group_size)
    n_pad, k_pad = _ceil(n, ROW_ALIGN), _ceil(k, group)
    w32 = F.pad(w.detach().float(), (0, k_pad - k, 0, n_pad - n)).view(n_pad, k_pad // group, group)
    lo, hi = w32.amin(-1), w32.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(torch.finfo(dtype).tiny).to(dtype)
    zero = (lo + 8 * scale.float()).to(dtype)
    codes = ((w32 - zero.float().unsqueeze(-1)) / scale.float().unsqueeze(-1) + 8).round_().clamp_(0, 15)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.view(n_pad, k_pad).to(torch.int32), 1)
    scale_zero = torch.stack([scale, zero], -1).transpose(0, 1).contiguous()
    return packed, scale_zero, group


def kernel_linear(x: Tensor, packed: Tensor, scale_zero: Tensor, group: int, n: int) -> Tensor:
    """``x @ w.T`` [M, n] for x [M, K] through ``_weight_int4pack_mm_for_cpu`` (x padded to the packed K)."""
    k_pad = packed.shape[-1] * 2
    if x.shape[-1] != k_pad:
        x = F.pad(x, (0, k_pad - x.shape[-1]))
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), packed, group, scale_zero.to(x.dtype))
    return out if out.shape[-1] == n else out[:, :n]


def unpack_codes(packed: Tensor) -> Tensor:
    """The [N, K] codes (uint8, 0..15) of ``_convert_weight_to_int4pack_for_cpu``'s [N, K/2] output, as
    it lays them out on an AVX-512 CPU: blocks of 64 output rows, each [K, 32] bytes whose low
    nibbles are rows 0..31 of the block and high nibbles rows 32..63; a last block of fewer rows
    holds consecutive rows in each byte's low and high nibble. :func:`layout_known` checks it."""
    n, half = packed.shape
    k = half * 2
    flat = packed.reshape(-1)
    full = n // 64 * 64
    parts = []
    if full:
        blocks = flat[: full * half].view(full // 64, k, 32)
        parts.append(torch.cat([blocks & 15, blocks >> 4], -1).transpose(1, 2).reshape(full, k))
    if n > full:
        tail = flat[full * half :].view(k, (n - full) // 2)
        parts.append(torch.stack([tail & 15, tail >> 4], -1).reshape(k, n - full).T)
    return torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()


@cache
def layout_known(n: int, k: int) -> bool:
    """Whether :func:`unpack_codes` reads this machine's packing of a [n, k] weight (checked once per
    shape by packing random codes and reading them back)."""
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    try:
        return bool(torch.equal(unpack_codes(packed).to(torch.int32), codes))
    except RuntimeError:  # another layout's sizes do not even reshape
        return False


def dequantize(packed: Tensor, scale_zero: Tensor, group: int, n: int, k: int, dtype: torch.dtype) -> Tensor:
    """The [n, k] weight the kernel multiplies, in ``dtype`` (``(q - 8) * s + z`` per group)."""
    n_pad, k_pad = packed.shape[0], packed.shape[1] * 2
    if not layout_known(n_pad, k_pad):
        eye = torch.eye(k_pad, dtype=torch.float32, device=packed.device)
        w = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, group, scale_zero.float()).T
        return w[:n, :k].to(dtype)
    codes = unpack_codes(packed).view(n_pad, k_pad // group, group).float()
    scale, zero = scale_zero.float().permute(2, 1, 0)  # [N', K'/g] each
    # q·s + (z − 8s) in float32, in place, one cast at the end: 4x faster than addcmul in bf16
    w = codes.mul_(scale.unsqueeze(-1)).add_((zero - 8 * scale).unsqueeze(-1)).view(n_pad, k_pad)
    return w[:n, :k].to(dtype)


def int4_linear(x: Tensor, packed: Tensor, scale_zero: Tensor, group: int, n: int, k: int) -> Tensor:
    """``x @ w.T`` for x [M, k]: one row through moectl's int4 row loop (``moectl.kernels.int4_row``)
    where it applies; bf16 rows from :data:`INT4_UNPACK_MIN_ROWS` on, the weight dequantised
    by moectl's C loop (``moectl.kernels.unpack``) and PyTorch's bf16 product; else the kernel for
    up to :data:`INT4_KERNEL_MAX_ROWS` rows (or any rows where the packed layout is not known), else
    the weight dequantised here and its product (moectl's bf16 kernel where it applies, as
    ``nn.Linear`` layers run, else ``F.linear``).

    float32 activations always take the dequantised product where the layout is known: the kernel's
    float32 path is slow at any row count (one thread, [2048, 2048], g64: 1 row 6.9 ms against 5.9 ms
    dequantised, 8 rows 54.5 against 7.1, 64 rows 443 against 10.2; [256, 256]: 0.11 / 0.87 / 6.9 ms
    against 0.10 / 0.10 / 0.16), where bf16 activations take it in 7-102 µs at [256, 256]."""
    fp32 = x.dtype == torch.float32
    many = x.dtype == torch.bfloat16 and x.shape[0] >= INT4_UNPACK_MIN_ROWS
    if many and unpack.int4_applies(packed, scale_zero) and layout_known(packed.shape[0], packed.shape[1] * 2):
        w = unpack.int4_unpacked(packed, scale_zero, group)  # [N', K'], moectl's C dequantisation
        rows = x if x.shape[-1] == w.shape[1] else F.pad(x, (0, w.shape[1] - x.shape[-1]))
        out = F.linear(rows, w)
        return out if out.shape[-1] == n else out[:, :n]
    if int4_row.applies(x, packed, scale_zero) and layout_known(packed.shape[0], packed.shape[1] * 2):
        return int4_row.linear(x, packed, scale_zero, group, n)  # one row: moectl's C loop
    if (x.shape[0] <= INT4_KERNEL_MAX_ROWS and not fp32) or not layout_known(packed.shape[0], packed.shape[1] * 2):
        return kernel_linear(x, packed, scale_zero, group, n)
    w = dequantize(packed, scale_zero, group, n, k, x.dtype)
    if bf16_rows.applies(x, w):
        return bf16_rows.linear(x, w, None)
    return F.linear(x, w)
