"""int4 codes in a form any machine reads: two codes a byte, row-major (issue 40 item 2).

``aten._convert_weight_to_int4pack_for_cpu`` lays the codes out in blocks of its own, which depend
on the CPU (AVX-512 or not) and on the PyTorch version (``moectl.quant.int4_groups.unpack_codes``
reads one of them). A checkpoint written on one machine and read on another must not hold that
layout, so a quantized checkpoint stores the codes *portably*:

    portable[e, n, j] = code[e, n, 2j] | code[e, n, 2j + 1] << 4      (uint8, [E, N', K'/2])

with ``code`` in 0..15 and ``N'``, ``K'`` the padded sizes the kernel takes (``int4_groups``): the
same bytes as the packed form, half a byte a weight. At load :func:`to_kernel` packs them for this
machine's kernel, far cheaper than quantizing (no scales to find, no rounding). Where
:func:`int4_groups.layout_known` says ``unpack_codes`` reads this machine's layout (a bijection,
checked against the packing op once per shape) it applies the inverse, vectorised over all experts
(:func:`_kernel_layout`); elsewhere it calls ``_convert_weight_to_int4pack_for_cpu`` once per expert.
On a [64, 2048, 2048] stack (OLMoE-1B-7B's gate/up of one layer), one thread, this 2-core machine
at load average ~5: 0.35-0.47 s the inverse, 0.95 s the op (0.4 s of it the int32 copy it takes).
:func:`to_portable` reads the packed form back the same two ways: the inverse of
:func:`_kernel_layout`, else by asking the kernel itself (an identity product with scale 1 and zero
8 gives each code exactly, as a small integer in float32) — slower, never wrong.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moectl.quant import int4_groups


def _nibbles(codes: Tensor) -> Tensor:
    """[..., K] codes 0..15 -> [..., K/2] uint8, code 2j in the low nibble of byte j."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _codes(portable: Tensor) -> Tensor:
    """[..., K/2] portable bytes -> [..., K] codes (uint8, 0..15)."""
    return torch.stack([portable & 15, portable >> 4], -1).flatten(-2)


def _interleave(lo: Tensor, hi: Tensor) -> Tensor:
    """Kernel bytes [E, G * M * 2 * R] of two row sets [E, G, R, M] of portable bytes whose codes the
    kernel puts in one byte (``lo`` rows in the low nibbles): for each group, input pair m and
    parity (even input, odd input), R bytes. Each byte made once, by two ops on the transposed views."""
    e, g, r, m = lo.shape
    out = torch.empty(e, g, m, 2, r, dtype=torch.uint8, device=lo.device)
    lo_t, hi_t = lo.transpose(-1, -2), hi.transpose(-1, -2)  # [E, G, M, R]
    torch.bitwise_or(lo_t & 15, hi_t << 4, out=out[:, :, :, 0])  # even inputs: the low nibbles
    torch.bitwise_or(lo_t >> 4, hi_t & 0xF0, out=out[:, :, :, 1])  # odd inputs: the high nibbles
    return out.reshape(e, -1)


def _kernel_layout(portable: Tensor) -> Tensor:
    """[E, N, K/2] portable bytes -> [E, N, K/2] bytes in the layout ``int4_groups.unpack_codes`` reads
    (its inverse): blocks of 64 rows, each [K, 32] bytes, rows 0..31 in the low nibbles and 32..63 in
    the high ones; a last block of fewer rows, [K, rows / 2] bytes, consecutive rows in each byte's
    low and high nibble. From the portable bytes directly (0.35 s for a [64, 2048, 2048] stack, one
    thread, where unpacking the codes first took 0.95 s)."""
    e, n, half = portable.shape
    full = n // 64 * 64
    parts = []
    if full:
        blocks = portable[:, :full].reshape(e, full // 64, 2, 32, half)
        parts.append(_interleave(blocks[:, :, 0], blocks[:, :, 1]))
    if n > full:
        pairs = portable[:, full:].reshape(e, (n - full) // 2, 2, half)
        parts.append(_interleave(pairs[:, None, :, 0], pairs[:, None, :, 1]))
    return torch.cat(parts, -1).view(e, n, half)


def _codes_of_layout(packed: Tensor) -> Tensor:
    """The inverse of :func:`_kernel_layout`: [E, N, K/2] packed bytes -> [E, N, K] codes."""
    e, n, half = packed.shape
    k, full = half * 2, n // 64 * 64
    flat = packed.reshape(e, -1)
    parts = []
    if full:
        blocks = flat[:, : full * half].view(e, full // 64, k, 32)
        parts.append(torch.cat([blocks & 15, blocks >> 4], -1).transpose(-1, -2).reshape(e, full, k))
    if n > full:
        tail = flat[:, full * half :].view(e, k, (n - full) // 2)
        parts.append(torch.stack([tail & 15, tail >> 4], -1).reshape(e, k, n - full).transpose(1, 2))
    return torch.cat(parts, 1)


def _codes_by_kernel(packed: Tensor, group: int, n_pad: int, k_pad: int) -> Tensor:
    """[N', K'] codes of one packed weight read through the kernel: ``(q - 8) * 1 + 8`` is ``q``."""
    scale_zero = torch.tensor([1.0, 8.0]).expand(k_pad // group, n_pad, 2).contiguous()
    eye = torch.eye(k_pad, dtype=torch.float32)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, group, scale_zero)  # [K', N']
    return out.T.round().to(torch.uint8)


def to_portable(packed: Tensor, group: int, n_pad: int, k_pad: int) -> Tensor:
    """[E, N', K'/2] portable bytes of the stacked kernel-packed weights ``packed`` [E, ...] (N', K'
    the padded sizes, ``group`` the weights' group)."""
    if int4_groups.layout_known(n_pad, k_pad):
        return _nibbles(_codes_of_layout(packed))
    return _nibbles(torch.stack([_codes_by_kernel(p, group, n_pad, k_pad) for p in packed]))


def to_kernel(portable: Tensor) -> Tensor:
    """The stacked kernel-packed weights of [E, N', K'/2] portable bytes, for this machine's
    ``_weight_int4pack_mm_for_cpu``."""
    if int4_groups.layout_known(portable.shape[1], portable.shape[2] * 2):
        return _kernel_layout(portable)
    convert = torch.ops.aten._convert_weight_to_int4pack_for_cpu
    return torch.stack([convert(_codes(p).to(torch.int32), 1) for p in portable])
