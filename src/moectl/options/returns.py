"""Returns, GAE(λ) and advantage normalisation (TE-MoE §4.3 and appendix A2).

All functions work on [B, S] step tensors with a ``valid`` mask; steps after a sequence ends
contribute nothing, and the step before an end bootstraps with 0 (the episode ends).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def discounted_cumsum(x: Tensor, discount: float) -> Tensor:
    """out_t = Σ_{j≥0} discount^j x_{t+j} along the last dim (vectorised as one triangular matmul)."""
    s = x.shape[-1]
    idx = torch.arange(s, device=x.device)
    power = (idx[:, None] - idx[None, :]).to(x.dtype)  # [i, t] = i − t
    m = torch.where(
        power >= 0, torch.as_tensor(discount, dtype=x.dtype, device=x.device) ** power.clamp(min=0), 0.0
    )
    return x @ m


def gae(delta: Tensor, valid: Tensor, gamma: float, lam: float) -> Tensor:
    """Â_t = Σ_j (γλ)^j δ_{t+j} over valid steps (Algorithm 2 lines 8 and 10)."""
    return discounted_cumsum(delta * valid, gamma * lam) * valid


def monte_carlo_returns(rewards: Tensor, valid: Tensor, gamma: float) -> Tensor:
    """Ḡ_t = Σ_{j=0}^{T−t−1} γ^j r_{t+j} (appendix A2)."""
    return discounted_cumsum(rewards * valid, gamma) * valid


def _same(x: Tensor) -> Tensor:
    return x


def rms_normalise(
    adv: Tensor, where: Tensor, eps: float = 1e-8, total: Callable[[Tensor], Tensor] = _same
) -> Tensor:
    """A / RMS(A) over the positions in ``where`` (no mean centring: signs are kept; A2).

    ``total`` sums over the data-parallel ranks holding the rest of the batch (identity alone)."""
    count = total(where.sum()).clamp(min=1)
    rms = (total((adv * where).pow(2).sum()) / count).sqrt()
    return adv / (rms + eps)


def standardise(
    x: Tensor, where: Tensor, eps: float = 1e-8, total: Callable[[Tensor], Tensor] = _same
) -> Tensor:
    """(x − μ)/σ over the positions in ``where`` (the intra-option advantage, A2); ``total`` as above."""
    count = total(where.sum()).clamp(min=1)
    mu = total((x * where).sum()) / count
    sigma = (total(((x - mu) * where).pow(2).sum()) / count).sqrt()
    return (x - mu) / (sigma + eps) * where
