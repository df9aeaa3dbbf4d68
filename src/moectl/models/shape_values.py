"""Deterministic random values for a named tensor, generated in bounded chunks.

A tensor's values depend only on (seed, its checkpoint name, its shape, dtype): the in-memory
model and the streamed checkpoint writer call the same function and get the same bytes, without
either ever holding more than one chunk of fresh values. Values follow a cheap version of the
usual initialisation: norm weights 1, norm biases 0, everything else N(0, 0.02), each chunk drawn
from its own seeded generator (so any chunk can be made without the ones before it).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator

import torch

STD = 0.02
CHUNK_ELEMENTS = 1 << 24  # 16M values: 32 MB of bf16 a chunk


def fill_kind(name: str) -> str:
    """``"ones"`` for norm weights, ``"zeros"`` for norm biases, ``"normal"`` for everything else."""
    if name.endswith(("norm.weight", "layernorm.weight")):
        return "ones"
    if name.endswith(("norm.bias", "layernorm.bias")):
        return "zeros"
    return "normal"


def _generator(seed: int, name: str, chunk: int) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}\0{name}\0{chunk}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


def rows_per_chunk(shape: tuple[int, ...]) -> int:
    """Rows (slices along dim 0) per chunk: as many as fit in ``CHUNK_ELEMENTS`` values, at least one."""
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, CHUNK_ELEMENTS // max(row, 1))


def value_chunks(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield ``(first_row, values)`` blocks along dim 0 that together make the tensor ``name``."""
    shape = tuple(int(s) for s in shape)
    if not shape:  # a scalar is the one-row tensor of the same name, reshaped
        _, block = next(value_chunks(name, (1,), dtype, seed))
        yield 0, block.reshape(())
        return
    kind = fill_kind(name)
    step = rows_per_chunk(shape)
    for index, start in enumerate(range(0, shape[0], step)):
        block = torch.empty((min(step, shape[0] - start), *shape[1:]), dtype=dtype)
        if kind == "ones":
            block.fill_(1.0)
        elif kind == "zeros":
            block.zero_()
        else:
            block.normal_(0.0, STD, generator=_generator(seed, name, index))
        yield start, block


def make_values(name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """The whole tensor ``name`` at once (for small tensors and tests)."""
    out = torch.empty(shape, dtype=dtype)
    fill_values(out, name, seed)
    return out


@torch.no_grad()
def fill_values(target: torch.Tensor, name: str, seed: int) -> None:
    """Write the values of tensor ``name`` into ``target`` (any device), one chunk at a time."""
    for start, block in value_chunks(name, tuple(target.shape), target.dtype, seed):
        if target.dim() == 0:
            target.copy_(block)
        else:
            target[start : start + block.shape[0]].copy_(block)
