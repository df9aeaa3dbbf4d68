"""One row times an int4 weight by moectl's C loop, the decoding step's int4 product (issue 40).

``moectl_int4_row`` (in ``unpack.c``, beside the int4 dequantisation that reads the same packing)
reads ``moectl.quant.int4_groups``' weights in PyTorch's CPU packing (blocks of 64 output rows, a
bf16 scale and zero per group) and computes each group's share as ``s * sum(x q) + (z - 8 s) *
sum(x)`` in fp32, each code read once and widened in registers, the scales applied once per group.
Against ``aten._weight_int4pack_mm_for_cpu`` at one row, 2 threads, 200 [2048, 2048] g64 weights in
turn (from memory, quiet, medians of 5): 17.6-17.9 against 15.5 GB/s of codes and scales; its
results are fp32 sums rounded once to the activations' dtype (within 5e-5 of a float64 product of
the dequantised weight where PyTorch's kernel, rounding to bf16, is within one bf16 step). A bf16
row, on a CPU with AVX512-BF16 and VBMI, is summed by bf16 dot products (``vdpbf16ps``, the codes as
the bf16 numbers 128 + q, exact; the products exact in fp32 and summed there, the group's share
``s * acc + (z - 136 s) * sum(x)``): widening each code to fp32 bound the loop by arithmetic on an AMD
EPYC (Zen 4), 11-12 GB/s on one thread; the dot products read 15-17 (21.9 -> 28.1 GB/s on two
threads, ``benchmarks/int4_dp.py``), results within one bf16 step of the exact product.

:func:`grouped` runs every expert's rows of a decoding step in one call (rows sorted by expert, as
``models.grouped_mm`` groups them), each row as :func:`linear` computes it, up to
:data:`GROUPED_MAX_ROWS` rows: without it each int4 expert a step used cost two Python-level calls
(a few hundred a token at OLMoE-1B-7B's width).

Used where :func:`applies`: one row, bf16 scales, output rows a multiple of 64 (the callers check
that the packing's layout is the one read here, ``int4_groups.layout_known``), an AVX-512 CPU (the
plain-C loop, built elsewhere, is slower than PyTorch's kernel), the kernels built and
``MOECTL_CPU_KERNELS`` not 0.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor

from moectl.kernels import bf16_rows, unpack
from moectl.kernels.kernel_build import cpu_flags

BLOCK = unpack.BLOCK  # output rows per packed block
GROUPED_MAX_ROWS = 64  # (token, expert) rows up to which :func:`grouped` runs: a decoding step's, 8 rows x top-8


@cache
def _lib() -> ctypes.CDLL | None:
    """``unpack.c`` built and loaded on an AVX-512 CPU (None: elsewhere, or not built)."""
    if "avx512f" not in cpu_flags().split():
        return None
    return unpack._lib()


def applies(x: Tensor, packed: Tensor, scale_zero: Tensor) -> bool:
    """Whether :func:`linear` can take ``x`` [1, K] times this int4 weight (see the module doc)."""
    if x.dim() != 2 or x.shape[0] != 1 or x.device.type != "cpu" or packed.device.type != "cpu":
        return False
    if x.dtype not in (torch.bfloat16, torch.float32) or scale_zero.dtype != torch.bfloat16:
        return False
    if packed.dim() != 2 or packed.shape[0] % BLOCK or not (packed.is_contiguous() and scale_zero.is_contiguous()):
        return False
    return bf16_rows.wanted() and _lib() is not None


def linear(x: Tensor, packed: Tensor, scale_zero: Tensor, group: int, n: int) -> Tensor:
    """``x @ w.T`` [1, n] in ``x``'s dtype (bf16 or fp32) for the weight of ``packed`` [N', K'/2] and
    ``scale_zero`` [K'/g, N', 2], where :func:`applies` (``x`` zero-padded to K'). The C loop reads
    and writes bf16 itself: the decoding step calls this a few hundred times a token at OLMoE-1B-7B's
    width, so nothing here converts or copies where it need not."""
    n_pad, k_pad = packed.shape[0], packed.shape[1] * 2
    if x.shape[-1] != k_pad:
        x = F.pad(x, (0, k_pad - x.shape[-1]))
    x = x.contiguous()
    out = torch.empty(1, n_pad, dtype=x.dtype)
    _lib().moectl_int4_row(x.data_ptr(), packed.data_ptr(), scale_zero.data_ptr(), n_pad, k_pad, group,
                           out.data_ptr(), x.dtype == torch.bfloat16, torch.get_num_threads())  # fmt: skip
    return out if n == n_pad else out[:, :n]


def grouped_applies(x: Tensor, packed: Tensor, scale_zero: Tensor) -> bool:
    """Whether :func:`grouped` can take ``x`` [S, K] against the stacked ``packed`` [E, N', K'/2] and
    ``scale_zero`` [E, K'/g, N', 2] (see the module doc)."""
    if x.dim() != 2 or not 0 < x.shape[0] <= GROUPED_MAX_ROWS or x.device.type != "cpu":
        return False
    if x.dtype not in (torch.bfloat16, torch.float32) or scale_zero.dtype != torch.bfloat16 or packed.dim() != 3:
        return False
    if packed.shape[1] % BLOCK or not (packed.is_contiguous() and scale_zero.is_contiguous()):
        return False
    return bf16_rows.wanted() and _lib() is not None


def grouped(x: Tensor, packed: Tensor, scale_zero: Tensor, group: int, n: int, offsets: Tensor) -> Tensor:
    """Rows of ``x`` [S, K] sorted by expert (``offsets`` [E]: each expert's end row) times each one's
    weight: [S, n] in ``x``'s dtype, where :func:`grouped_applies`."""
    n_pad, k_pad = packed.shape[1], packed.shape[2] * 2
    if x.shape[-1] != k_pad:
        x = F.pad(x, (0, k_pad - x.shape[-1]))
    x = x.contiguous()
    ends = offsets.to(torch.int64).contiguous()
    out = torch.empty(x.shape[0], n_pad, dtype=x.dtype)
    scratch = torch.empty(x.shape[0], k_pad, dtype=torch.float32)
    _lib().moectl_int4_grouped_rows(
        x.data_ptr(), x.stride(0), ends.data_ptr(), ends.numel(), packed.data_ptr(), packed.stride(0),
        scale_zero.data_ptr(), scale_zero.stride(0), n_pad, k_pad, group, out.data_ptr(), n_pad,
        x.dtype == torch.bfloat16, scratch.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out if n == n_pad else out[:, :n]
