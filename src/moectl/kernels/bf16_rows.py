"""bf16 weight products on the CPU for inference, at the speed the memory allows.

On a CPU without AVX512-BF16 or AMX (most laptops and many servers), PyTorch's bf16 products are
slow in two ways, measured on a 2-core AVX-512 machine on 2026-11-27 (decoding:
``benchmarks/decode_kernels.py``; prefill: [512, 2048] × [2048, 2048] products timed on their own):

- **a few rows** (decoding): ``F.linear`` reads the weights at 13 GB/s for one row and 4 GB/s for
  8 rows, where the machine streams 25 GB/s; decoding a batch then costs per row, not per weight.
  :func:`linear` and :func:`grouped` run ``bf16_rows.c`` instead: each weight row is converted to
  fp32 in registers and multiplied with all the input rows while it is in cache;
- **many rows** (prefill): bf16 ``F.linear`` computes 30 G multiply-adds/s, fp32 ``F.linear`` 120:
  past :data:`FEW_ROWS` rows the weights are cast to fp32 a block at a time and multiplied in fp32.

Both accumulate in fp32 and round the result to bf16, as PyTorch's bf16 products do; the sums run in
another order, so results can differ from PyTorch's in the last bf16 bit. A row's result does not
depend on how many rows run beside it (up to the rows :func:`few` gives the kernel). Used only where no gradient is
needed, on CPU tensors in bf16, when the kernel could be built (:mod:`moectl.kernels.kernel_build`).

On CPUs with native bf16 products (``avx512_bf16`` or ``amx_bf16`` in the CPU flags) the few-row
kernel runs too: measured on such a 2-core machine on 2026-11-29 (quiet), oneDNN's bf16 one-row
product read 13.9-16.3 GB/s (1 thread; 27-31 with 2) against this kernel's 25.5-26.0 (53-58), 1.6-2.1x;
at 8 rows oneDNN's AMX path was 4-15% faster per product, but the engine's lean decoding still gained
end to end (interleaved in one process: reference model 1.50x at 1 row, 1.39x at 8; OLMoE-1B-7B dims,
2 layers, 1.17x / 1.07x). An earlier rule kept PyTorch's products on such CPUs (from a figure of 27
GB/s for one row measured on another machine). There the kernel takes only a few rows
(:func:`few`): oneDNN's AMX product barely grows with the rows and this kernel's time does, so past
:data:`NATIVE_FEW_ROWS` rows (:data:`NATIVE_SMALL_ROWS` for weights of :data:`SMALL_WEIGHT_BYTES` or
less, where oneDNN's ~18 us a call dominates) PyTorch's bf16 product runs (measured 2026-11-29, quiet,
medians of 5, this kernel's time over oneDNN's, 1 / 2 threads: [2048, 2048] 0.99 / 0.91 at 5 rows,
1.10 / 1.05 at 6, 2.08 / 2.08 at 16; the 50304-row LM head 0.98 / 0.96 at 5, 1.70 / 1.78 at 16;
[256, 256] 0.97 / 0.76 at 12, 1.20 / 1.06 at 16). Before, 48 rows took the kernel there too: up to
3x slower products for 10-48 rows (prefill chunks, batched and RoE decoding). The environment variable ``MOECTL_CPU_KERNELS`` overrides: ``0``
never, ``1`` on any CPU. Elsewhere the callers keep PyTorch's products.
"""

from __future__ import annotations

import ctypes
import itertools
import os
from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor

from moectl.kernels.kernel_build import cpu_flags, load

FEW_ROWS = 48  # rows up to which the C kernel runs; past it, blocks cast to fp32 (measured crossover ≈ 64)
# CPUs with native bf16 products: the kernel up to this many rows, PyTorch's product past them (module doc)
NATIVE_FEW_ROWS, NATIVE_SMALL_ROWS, SMALL_WEIGHT_BYTES = 5, 12, 256 << 10
WIDE_BLOCK_BYTES = 32 << 20  # fp32 bytes of weight cast at once on the many-rows path

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@cache
def native_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (then PyTorch's bf16 products are fast)."""
    flags = cpu_flags().split()
    return any(flag in flags for flag in NATIVE_BF16_FLAGS)


@cache
def wanted() -> bool:
    """Whether the products should run here (``MOECTL_CPU_KERNELS``: 0 never, else yes; see the module doc)."""
    return os.environ.get("MOECTL_CPU_KERNELS", "auto") != "0"


def refresh() -> None:
    """Read ``MOECTL_CPU_KERNELS`` again (tests change it)."""
    wanted.cache_clear()
    getattr(native_bf16, "cache_clear", lambda: None)()  # tests replace it with a plain function
    _lib.cache_clear()


@cache
def _lib() -> ctypes.CDLL | None:
    if os.environ.get("MOECTL_CPU_KERNELS") == "0":
        return None
    lib = load("bf16_rows")
    if lib is None:
        return None
    lib.moectl_bf16_linear.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _i64, _int]
    lib.moectl_bf16_linear.restype = None
    lib.moectl_bf16_grouped.argtypes = [
        _ptr,
        _i64,
        _ptr,
        _i64,
        _ptr,
        _i64,
        _i64,
        _i64,
        _i64,
        _ptr,
        _i64,
        _ptr,
        _int,
    ]
    lib.moectl_bf16_grouped.restype = None
    lib.moectl_int8_linear.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _i64, _i64, _ptr, _i64, _int]
    lib.moectl_int8_linear.restype = None
    lib.moectl_int8_grouped.argtypes = [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _i64,
                                        _ptr, _int]  # fmt: skip
    lib.moectl_int8_grouped.restype = None
    return lib


def available() -> bool:
    """Whether the C kernel is built and loaded on this machine."""
    return _lib() is not None


def applies(x: Tensor, w: Tensor) -> bool:
    """Whether ``x`` @ ``w``ᵀ should run here: both bf16 on the CPU, no gradient wanted, ``w``'s rows
    contiguous, not switched off (:func:`wanted`) and the kernel available."""
    if (
        x.device.type != "cpu"
        or w.device.type != "cpu"
        or x.dtype != torch.bfloat16
        or w.dtype != torch.bfloat16
    ):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return False
    return w.stride(-1) == 1 and wanted() and available()


def few(rows: int, w: Tensor) -> bool:
    """Whether ``rows`` rows times ``w`` run in the C kernel: up to :data:`FEW_ROWS`, or on a CPU with
    native bf16 products up to :data:`NATIVE_FEW_ROWS` (:data:`NATIVE_SMALL_ROWS` for a small weight)."""
    if rows > FEW_ROWS:
        return False
    if not native_bf16():
        return True
    small = w.numel() * w.element_size() <= SMALL_WEIGHT_BYTES
    return rows <= (NATIVE_SMALL_ROWS if small else NATIVE_FEW_ROWS)


def linear(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, w, bias)`` for bf16 ``x`` [..., K] and ``w`` [N, K] where :func:`applies`."""
    rows = x.reshape(-1, x.shape[-1])
    kernel = few(rows.shape[0], w)
    if not kernel and native_bf16():
        return F.linear(x, w, bias)  # PyTorch's bf16 product (AMX / AVX512-BF16)
    out = _few(rows, w) if kernel else _many(rows, w)
    out = out if bias is None else out + bias.float()
    return out.to(torch.bfloat16).reshape(*x.shape[:-1], w.shape[0])


def _few(rows: Tensor, w: Tensor) -> Tensor:
    x32 = rows.float().contiguous()
    m, k = x32.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        _lib().moectl_bf16_linear(
            x32.data_ptr(), k, m, w.data_ptr(), w.stride(0), n, k, y.data_ptr(), n, torch.get_num_threads()
        )
    return y


def _many(rows: Tensor, w: Tensor) -> Tensor:
    """More than :data:`FEW_ROWS` rows, in fp32: PyTorch's bf16 product where the CPU has native bf16
    products (AMX / AVX512-BF16), else fp32 blocks (:func:`_wide`)."""
    return F.linear(rows, w).float() if native_bf16() else _wide(rows, w)


def _wide(rows: Tensor, w: Tensor) -> Tensor:
    """fp32 products a block of weight rows at a time (the fp32 copy of ``w`` is never whole)."""
    x32 = rows.float()
    step = max(1, WIDE_BLOCK_BYTES // (4 * w.shape[1]))
    if step >= w.shape[0]:
        return F.linear(x32, w.float())
    return torch.cat([F.linear(x32, w[i : i + step].float()) for i in range(0, w.shape[0], step)], dim=-1)


def grouped(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """Rows of ``x`` [S, K] sorted by group, times ``w[e]`` [N, K]ᵀ for group e (``offsets`` [E]: each
    group's end row, as ``F.grouped_mm`` takes): [S, N] in bf16. ``w`` [E, N, K] with contiguous rows."""
    ends = offsets.to(torch.int64)
    if x.shape[0] > FEW_ROWS:  # a prefill: each group by its own size (one host read of the sizes)
        bounds = [0, *ends.tolist()]
        parts = [
            (_few if few(b - a, w[e]) else _many)(x[a:b], w[e])
            for e, (a, b) in enumerate(itertools.pairwise(bounds))
            if b > a
        ]
        return _aligned_bf16(torch.cat(parts))  # more than FEW_ROWS rows: some group has rows
    x32 = x.float().contiguous()
    s, k = x32.shape
    n = w.shape[1]
    y = torch.empty(s, n, dtype=torch.float32)
    ends = ends.contiguous()
    scratch = torch.empty(ends.numel(), dtype=torch.int64)  # the kernel's list of groups with rows
    if s:
        _lib().moectl_bf16_grouped(
            x32.data_ptr(),
            k,
            ends.data_ptr(),
            ends.numel(),
            w.data_ptr(),
            w.stride(0),
            w.stride(1),
            n,
            k,
            y.data_ptr(),
            n,
            scratch.data_ptr(),
            torch.get_num_threads(),
        )
    return _aligned_bf16(y)


def _aligned_bf16(y: Tensor) -> Tensor:
    """``y`` [S, N] in bf16 with rows 16-byte aligned, as ``F.grouped_mm`` wants its inputs (a LoRA
    rank of 4 gives 8-byte rows: the next grouped product of the chain takes this output)."""
    n = y.shape[1]
    padded = -(-n // 8) * 8
    if padded == n:
        return y.to(torch.bfloat16)
    out = torch.empty(y.shape[0], padded, dtype=torch.bfloat16)[:, :n]
    return out.copy_(y)
