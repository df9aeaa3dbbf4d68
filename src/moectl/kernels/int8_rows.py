"""int8 weight products of a few rows on the CPU, at the speed the memory allows (issue 40 item 1).

Weights are int8 codes [N, K] with one float32 scale per output row (``moectl.offload.int8``'s
format). PyTorch's kernel for them (``aten._weight_int8pack_mm``) read int8 weights at 4.2 GB/s
for one row on this 2-core AVX-512 machine, where moectl's bf16 kernel reads bf16 at 7.0 (OLMoE-1B-7B
dimensions, one thread; ``benchmarks/quant_kernel_gbs.py``): an int8 model decoded slower than
llama.cpp's Q8_0 (0.73x). :func:`linear` and :func:`grouped` run the int8 twins of
``bf16_rows.c`` (each weight row widened to fp32 in registers and multiplied with every input row
while it is in cache, fp32 sums scaled once), up to :data:`moectl.kernels.bf16_rows.FEW_ROWS` rows.
The result is rounded to the input's dtype; a row's result does not depend on the rows beside it.
Used where :func:`applies` (CPU, no gradient, the kernel built, ``MOECTL_CPU_KERNELS`` not 0);
elsewhere the callers keep PyTorch's kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moectl.kernels import bf16_rows


def applies(x: Tensor, q: Tensor) -> bool:
    """Whether ``x`` [M, K] times int8 ``q`` [..., N, K] should run here (see the module doc)."""
    if x.device.type != "cpu" or q.device.type != "cpu" or q.dtype != torch.int8 or x.dim() != 2:
        return False
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or x.shape[0] > bf16_rows.FEW_ROWS:
        return False
    if torch.is_grad_enabled() and x.requires_grad:
        return False
    return q.stride(-1) == 1 and bf16_rows.wanted() and bf16_rows.available()


def linear(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """``x @ (q * scale[:, None]).T`` for ``x`` [M, K], ``q`` [N, K] int8, ``scale`` [N] float32,
    in ``x``'s dtype, where :func:`applies`."""
    x32 = x.float().contiguous()
    m, k = x32.shape
    n = q.shape[0]
    s = scale.float().contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        bf16_rows._lib().moectl_int8_linear(
            x32.data_ptr(), k, m, q.data_ptr(), q.stride(0), s.data_ptr(), n, k, y.data_ptr(), n,
            torch.get_num_threads(),
        )  # fmt: skip
    return y.to(x.dtype)


def grouped(x: Tensor, q: Tensor, scale: Tensor, offsets: Tensor) -> Tensor:
    """Rows of ``x`` [S, K] sorted by group times ``q[e] * scale[e]`` ([E, N, K] int8, [E, N]
    float32) for group e (``offsets`` [E]: each group's end row): [S, N] in ``x``'s dtype, one call
    for every group (where :func:`applies`)."""
    x32 = x.float().contiguous()
    s_rows, k = x32.shape
    n = q.shape[1]
    s = scale.float().contiguous()
    ends = offsets.to(torch.int64).contiguous()
    y = torch.empty(s_rows, n, dtype=torch.float32)
    scratch = torch.empty(ends.numel(), dtype=torch.int64)
    if s_rows:
        bf16_rows._lib().moectl_int8_grouped(
            x32.data_ptr(), k, ends.data_ptr(), ends.numel(), q.data_ptr(), q.stride(0), q.stride(1),
            s.data_ptr(), s.stride(0), n, k, y.data_ptr(), n, scratch.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
    return y.to(x.dtype)
