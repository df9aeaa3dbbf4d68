"""Quantized weights dequantised to bf16 by moectl's C loops, for products of many rows (issue 40).

Past a few rows a dequantised weight and PyTorch's bf16 product (AMX or AVX-512), whose time barely
grows with the rows, beat the quantized kernels, whose time does. Dequantising with tensor code was
the cost: 6.0 ms (int4) and 9.8 ms (int8) for a [2048, 2048] weight, 2 threads. Two C loops write
the same values bit for bit in a fraction of that, both in ``unpack.c`` (one fp32 -> bf16 rounding):

- ``moectl_int4_unpack``, for ``moectl.quant.int4_groups``' weights (codes packed by PyTorch's
  ``aten._convert_weight_to_int4pack_for_cpu``, blocks of 64 output rows, a bf16 scale and zero per
  group): each block's codes read once and the weight written transposed, [K, N], so both sides stay
  sequential (the packing holds, for each input k, 64 consecutive output rows); ``q s + (z - 8 s)``
  in fp32, rounded to nearest even (``int4_groups.dequantize``'s values), 0.35 ms for [2048, 2048].
  :func:`int4_unpacked` returns the [N, K] view the product takes.
- ``moectl_int8_unpack``, for ``moectl.offload.int8``'s weights (int8 codes, a float32 scale per output
  row): ``q s`` in fp32 rounded to bf16 (``int8.dequantize_rows``' values).

Used where ``int4_applies`` / ``int8_applies``: the CPU, the scales' dtype above, contiguous rows
(int4: output rows a multiple of 64; the callers check that the packing's layout is the one read
here, ``int4_groups.layout_known``), the kernels built, ``MOECTL_CPU_KERNELS`` not 0.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch
from torch import Tensor

from moectl.kernels import bf16_rows
from moectl.kernels.kernel_build import load

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
BLOCK = 64  # output rows per packed int4 block
_SIGNATURES = {  # unpack.c's functions -> their argument types
    "moectl_int4_unpack": [_ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _int],
    "moectl_int8_unpack": [_ptr, _i64, _ptr, _i64, _i64, _ptr, _i64, _int],
    "moectl_int4_row": [_ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _int, _int],  # moectl.kernels.int4_row
    "moectl_int4_grouped_rows": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _ptr, _i64, _int,
                                 _ptr, _int],
}


@cache
def _lib() -> ctypes.CDLL | None:
    """``moectl/kernels/unpack.c`` built and loaded, its functions typed (None: not built)."""
    lib = load("unpack")
    if lib is None:
        return None
    for name, types in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = types, None
    return lib


def int4_applies(packed: Tensor, scale_zero: Tensor) -> bool:
    """Whether :func:`int4_unpacked` can dequantise this int4 weight (see the module doc; whether the
    packing's layout is the one read here is the caller's check, ``int4_groups.layout_known``)."""
    if packed.device.type != "cpu" or scale_zero.dtype != torch.bfloat16 or packed.dim() != 2:
        return False
    if packed.shape[0] % BLOCK or not (packed.is_contiguous() and scale_zero.is_contiguous()):
        return False
    return bf16_rows.wanted() and _lib() is not None


def int4_unpacked(packed: Tensor, scale_zero: Tensor, group: int) -> Tensor:
    """The [N', K'] bf16 weight of ``packed`` [N', K'/2] and ``scale_zero`` [K'/g, N', 2] (a transposed
    view of a [K', N'] tensor), where :func:`int4_applies`."""
    n, k = packed.shape[0], packed.shape[1] * 2
    out = torch.empty(k, n, dtype=torch.bfloat16)
    _lib().moectl_int4_unpack(
        packed.data_ptr(), scale_zero.data_ptr(), n, k, group, out.data_ptr(), n, torch.get_num_threads()
    )
    return out.t()


def int8_applies(q: Tensor, scale: Tensor) -> bool:
    """Whether :func:`int8_unpacked` can dequantise ``q`` [N, K] int8 with ``scale`` [N] (see the module doc)."""
    if q.device.type != "cpu" or q.dtype != torch.int8 or q.dim() != 2 or q.stride(-1) != 1:
        return False
    if scale.dtype != torch.float32 or scale.dim() != 1 or scale.numel() != q.shape[0] or not scale.is_contiguous():
        return False
    return bf16_rows.wanted() and _lib() is not None


def int8_unpacked(q: Tensor, scale: Tensor) -> Tensor:
    """``q * scale[:, None]`` as a bf16 [N, K] tensor, where :func:`int8_applies`."""
    n, k = q.shape
    out = torch.empty(n, k, dtype=torch.bfloat16)
    _lib().moectl_int8_unpack(q.data_ptr(), q.stride(0), scale.data_ptr(), n, k, out.data_ptr(), k,
                                           torch.get_num_threads())  # fmt: skip
    return out
