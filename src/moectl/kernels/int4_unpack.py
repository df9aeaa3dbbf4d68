"""int4 weights dequantised to bf16 by ``int4_unpack.c``, in the packing's own [K, N] order (issue 40).

``moectl.quant.int4_groups`` multiplies many rows with an int4 weight by dequantising it and calling
PyTorch's bf16 product, whose time barely grows with the rows (``aten._weight_int4pack_mm_for_cpu``
unpacks the codes again for every row). Its own dequantisation, tensor code over the unpacked codes,
took 5.1 ms for a [2048, 2048] weight (2 threads), so that only paid past 80 rows; this C loop reads
each block's codes once and writes the weight transposed, [K, N] (both sides sequential: the
packing holds, for each input k, 64 consecutive output rows), the same values
(``q s + (z - 8 s)`` in fp32, rounded to nearest even). :func:`unpacked` returns it as the [N, K]
view the product takes.

Used where :func:`applies`: the CPU, bf16 scales, output rows a multiple of 64, the packing's layout
the one read here (``int4_groups.layout_known``), the kernel built, ``MOECTL_CPU_KERNELS`` not 0.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch
from torch import Tensor

from moectl.kernels import bf16_rows
from moectl.kernels.kernel_build import load

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
BLOCK = 64


@cache
def _lib() -> ctypes.CDLL | None:
    lib = load("int4_unpack")
    if lib is None:
        return None
    lib.moectl_int4_unpack.argtypes = [_ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _int]
    lib.moectl_int4_unpack.restype = None
    return lib


def applies(packed: Tensor, scale_zero: Tensor) -> bool:
    """Whether :func:`unpacked` can dequantise this weight (see the module doc)."""
    from moectl.quant.int4_groups import layout_known

    if packed.device.type != "cpu" or scale_zero.dtype != torch.bfloat16 or packed.dim() != 2:
        return False
    if packed.shape[0] % BLOCK or not (packed.is_contiguous() and scale_zero.is_contiguous()):
        return False
    return bf16_rows.wanted() and _lib() is not None and layout_known(packed.shape[0], packed.shape[1] * 2)


def unpacked(packed: Tensor, scale_zero: Tensor, group: int) -> Tensor:
    """The [N', K'] bf16 weight of ``packed`` [N', K'/2] and ``scale_zero`` [K'/g, N', 2] (a transposed
    view of a [K', N'] tensor), where :func:`applies`."""
    n, k = packed.shape[0], packed.shape[1] * 2
    out = torch.empty(k, n, dtype=torch.bfloat16)
    _lib().moectl_int4_unpack(
        packed.data_ptr(), scale_zero.data_ptr(), n, k, group, out.data_ptr(), n, torch.get_num_threads()
    )
    return out.t()
