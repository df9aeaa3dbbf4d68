"""Counter-based random draws: a 32-bit integer hash of (seed, position, index) → uniforms in (0, 1).

A draw that is a function of *what it is for* — (seed, layer, sample or request, position, expert)
— rather than of a generator's call order is the same whatever the batch layout, the order of
requests or a KV cache. RoE's per-layer noise (``moectl.ensemble.noise``, keyed by sample and position)
and evaluation's per-request noise (``moectl.eval.request_noise``) both draw this way, through
these helpers.

Integers are int64 tensors holding values < 2**32 (``M32``); the multiply-xorshift rounds keep
every product below 2**59, so nothing overflows. Uniforms use 24 bits of the hash:
u = (h + 0.5) / 2**24 lies strictly inside (0, 1), so −log(−log u) is finite.
"""

from __future__ import annotations

import torch
from torch import Tensor

M32 = 0xFFFFFFFF
_MULT = 0x45D9F3B  # < 2**27: x * _MULT stays below 2**59 for x < 2**32, no int64 overflow
_SEED_SALT = 0x9E3779B9
_INDEX_MULT = 0x61C88647


def mix(x: Tensor) -> Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) on int64 tensors holding values < 2**32."""
    x = ((x >> 16) ^ x) * _MULT & M32
    x = ((x >> 16) ^ x) * _MULT & M32
    return (x >> 16) ^ x


def mix_int(x: int) -> int:
    """:func:`mix` on a Python int (its low 32 bits), for keys computed once per seed or layer."""
    x &= M32
    x = ((x >> 16) ^ x) * _MULT & M32
    x = ((x >> 16) ^ x) * _MULT & M32
    return (x >> 16) ^ x


def seed_key(seed: int) -> int:
    """The 32-bit key of a seed."""
    return mix_int(seed ^ _SEED_SALT)


def layer_word(layer: int) -> int:
    """A per-layer word to fold into a seed's key (callers mix it as their format fixed)."""
    return layer * 0x632BE5AB + 0x1B873593


def uniforms(token: Tensor, n: int) -> Tensor:
    """[*token.shape, n] float32 uniforms in (0, 1): the hash of (token code, index 0 … n − 1).

    ``token`` holds one 32-bit code per draw site (already mixed with its key); index i is an
    expert or a candidate.
    """
    index = torch.arange(n, dtype=torch.int64, device=token.device) * _INDEX_MULT & M32
    h = mix(token.unsqueeze(-1) ^ index)
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
