"""Rollout randomness keyed by the row of the global batch, so a step is the same on any number of processes.

A training rollout (Algorithm 2 lines 3–13) draws per generated token the token a_t ~ p_mix and,
per MoE layer, the switch d_t ~ Bern(β_t) and the Gumbel noise of a Plackett–Luce option. Drawn
from generator streams, these would depend on which rows share a process. Here every draw is a
hash of (run seed, step, the row's index in the global batch, what is drawn, MoE layer, position)
through :mod:`moectl.routing.keyed_hash` (RoE's and evaluation's scheme): two processes holding
half a batch each draw exactly what one process holding the whole batch draws, and a checkpoint
resumes on a different number of processes. Positions count a row's real tokens (from 0 at its
first prompt token), so left padding to a different width changes nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moectl.routing.keyed_hash import M32, layer_word, mix, mix_int, seed_key, uniforms

TOKEN, SWITCH, OPTION = 1, 2, 3  # what is drawn: the sampled token, d_t's uniform, the PL Gumbel noise
_STEP_MULT = 0x2545F491


def row_codes(seed: int, step: int, rows: Tensor) -> Tensor:
    """[B] 32-bit codes of the global batch's rows ``rows`` at training step ``step``."""
    base = mix_int(seed_key(seed) ^ (step * _STEP_MULT & M32))
    return mix(rows.long() ^ base)


def row_uniforms(codes: Tensor, positions: Tensor, what: int, layer: int, n: int) -> Tensor:
    """[B, T, n] uniforms in (0, 1) for rows ``codes`` [B] at ``positions`` [B, T]."""
    salt = mix_int(layer_word(layer) ^ (what * 0x9E3779B9 & M32))
    token = mix(mix(codes.long() ^ salt)[:, None] ^ (positions.long() & M32))
    return uniforms(token, n)


def sample_tokens(probs: Tensor, codes: Tensor, step: int) -> Tensor:
    """[B] tokens from ``probs`` [B, V] by inverse transform of row-keyed uniforms at generation step ``step``."""
    position = torch.full((codes.shape[0], 1), step, dtype=torch.long, device=codes.device)
    u = row_uniforms(codes, position, TOKEN, 0, 1)[:, 0].to(probs.device)  # [B, 1]
    cdf = probs.double().cumsum(-1)
    picked = torch.searchsorted(cdf, u.double() * cdf[:, -1:])  # first index with cdf ≥ u·total
    return picked.squeeze(-1).clamp(max=probs.shape[-1] - 1)
