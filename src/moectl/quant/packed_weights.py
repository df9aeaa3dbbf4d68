"""A stack of quantized [N, K] weights — one per expert, or one for a Linear — and the product with each.

Issue 40 item 1: weight-only int8 (per output channel) and int4 (group-wise) weights, multiplied by
PyTorch's CPU kernels. :class:`Int8Weights` keeps the format of ``moectl.offload.int8`` (symmetric
absmax per output row, float32 scales) and runs its ``int8_linear`` (the kernel for few rows where
K is a multiple of 16, a dequantised product elsewhere); :class:`Int4Weights` runs
``moectl.quant.int4_groups``. Both hold their tensors as buffers, so ``.to(device)``, ``state_dict``
and ``named_buffers`` see them; :meth:`QuantizedWeights.dequantize` gives back the weight a product
multiplies, for tests and for error measurements.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moectl.kernels import int4_row, int8_rows
from moectl.offload.int8 import dequantize_rows, int8_linear, quantize_rows
from moectl.quant import int4_groups


class QuantizedWeights(nn.Module):
    """[E, N, K] weights in a quantized form; ``linear(x, e)`` is ``x @ W[e].T``."""

    scheme = ""

    def __init__(self, shape: tuple[int, int, int], dtype: torch.dtype) -> None:
        super().__init__()
        self.num, self.out_features, self.in_features = (int(s) for s in shape)
        self.dtype = dtype  # the original weights' dtype: what dequantize returns by default

    def linear(self, x: Tensor, index: int = 0) -> Tensor:
        raise NotImplementedError

    def grouped(self, x: Tensor, offsets: Tensor) -> Tensor | None:
        """Every expert's rows in one call (rows sorted by expert), or None: one call per expert."""
        return None

    def dequantize(self, index: int = 0, dtype: torch.dtype | None = None) -> Tensor:
        raise NotImplementedError

    def nbytes(self) -> int:
        """Bytes the quantized form holds (codes and scales)."""
        return sum(b.numel() * b.element_size() for b in self.buffers(recurse=False))

    def extra_repr(self) -> str:
        return f"{self.scheme}, {self.num}x[{self.out_features}, {self.in_features}]"


class Int8Weights(QuantizedWeights):
    """int8 codes [E, N, K] and one float32 scale per output row [E, N] (``offload.int8.quantize_rows``)."""

    scheme = "int8"

    def __init__(self, w: Tensor) -> None:
        w = w if w.dim() == 3 else w.unsqueeze(0)
        super().__init__(tuple(w.shape), w.dtype)
        codes = torch.empty(w.shape, dtype=torch.int8, device=w.device)
        scale = torch.empty(w.shape[:-1], dtype=torch.float32, device=w.device)
        for e in range(w.shape[0]):  # one expert at a time: a float32 copy of one expert, not of all
            codes[e], scale[e] = quantize_rows(w[e].detach())
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)

    @classmethod
    def from_stored(cls, codes: Tensor, scale: Tensor, dtype: torch.dtype) -> Int8Weights:
        """The weights of a saved checkpoint (issue 40 item 2): ``codes`` int8 [E, N, K], ``scale``
        float32 [E, N], ``dtype`` the original weights' dtype; nothing is quantized again."""
        self = cls.__new__(cls)
        QuantizedWeights.__init__(self, tuple(codes.shape), dtype)
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        return self

    def linear(self, x: Tensor, index: int = 0) -> Tensor:
        return int8_linear(x, self.codes[index], self.scale[index])

    def grouped(self, x: Tensor, offsets: Tensor) -> Tensor | None:
        """Rows of ``x`` sorted by expert times each one's weights in one kernel call
        (``moectl.kernels.int8_rows.grouped``; ``offsets``: each expert's end row), or None where
        that kernel does not apply or the experts are offloaded (their buffers are then views of slots)."""
        codes, scale = self.codes, self.scale
        if not isinstance(codes, Tensor) or not isinstance(scale, Tensor) or not int8_rows.applies(x, codes):
            return None
        return int8_rows.grouped(x, codes, scale, offsets)

    def dequantize(self, index: int = 0, dtype: torch.dtype | None = None) -> Tensor:
        return dequantize_rows(self.codes[index], self.scale[index], dtype or self.dtype)


class Int4Weights(QuantizedWeights):
    """Packed int4 codes [E, N', K'/2] and a scale and zero per group [E, K'/g, N', 2] in the
    activations' dtype (``int4_groups.quantize``; N', K' padded to what the kernel takes)."""

    scheme = "int4"

    def __init__(self, w: Tensor, group_size: int) -> None:
        w = w if w.dim() == 3 else w.unsqueeze(0)
        super().__init__(tuple(w.shape), w.dtype)
        parts = [int4_groups.quantize(w[e], group_size, w.dtype) for e in range(w.shape[0])]
        self.group = parts[0][2]
        self.register_buffer("packed", torch.stack([p[0] for p in parts]))
        self.register_buffer("scale_zero", torch.stack([p[1] for p in parts]))

    @classmethod
    def from_stored(
        cls, packed: Tensor, scale_zero: Tensor, group: int, shape: tuple[int, int, int], dtype: torch.dtype
    ) -> Int4Weights:
        """The weights of a saved checkpoint (issue 40 item 2): ``packed`` [E, N', K'/2] as
        ``_convert_weight_to_int4pack_for_cpu`` packs them on this machine, ``scale_zero``
        [E, K'/group, N', 2], ``shape`` the unpadded [E, N, K]; nothing is quantized again."""
        self = cls.__new__(cls)
        QuantizedWeights.__init__(self, shape, dtype)
        self.group = int(group)
        self.register_buffer("packed", packed)
        self.register_buffer("scale_zero", scale_zero)
        return self

    def linear(self, x: Tensor, index: int = 0) -> Tensor:
        return int4_groups.int4_linear(
            x, self.packed[index], self.scale_zero[index], self.group, self.out_features, self.in_features
        )

    def grouped(self, x: Tensor, offsets: Tensor) -> Tensor | None:
        """A decoding step's rows, sorted by expert, times each one's weights in one call
        (``moectl.kernels.int4_row.grouped``), or None where it does not apply (more rows: a
        prefill, whose products dequantise; offloaded experts, whose buffers are views of slots)."""
        packed, scale_zero = self.packed, self.scale_zero
        if not isinstance(packed, Tensor) or not isinstance(scale_zero, Tensor):
            return None
        if not int4_row.grouped_applies(x, packed, scale_zero):
            return None
        if not int4_groups.layout_known(packed.shape[1], packed.shape[2] * 2):
            return None
        return int4_row.grouped(x, packed, scale_zero, self.group, self.out_features, offsets)

    def dequantize(self, index: int = 0, dtype: torch.dtype | None = None) -> Tensor:
        return int4_groups.dequantize(
            self.packed[index], self.scale_zero[index], self.group, self.out_features, self.in_features,
            dtype or self.dtype,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group {self.group}"


def quantize_weights(w: Tensor, scheme: str, group_size: int) -> QuantizedWeights:
    """``w`` ([E, N, K] or [N, K]) in ``scheme`` (``int8`` | ``int4``, checked by the caller)."""
    return Int8Weights(w) if scheme == "int8" else Int4Weights(w, group_size)
