"""Plackett–Luce option selection (TE-MoE §4.2, eq. 5): ordered k-hat samples and their log-probability.

Sampling uses the Gumbel-top-k trick: the top-k-hat indices of c + G, G ~ Gumbel(0, 1), in
descending order of the perturbed logits, are an ordered PL sample (i_1, ..., i_k). The policy
gradient uses the *ordered* log-probability of that tuple, not the probability of the set.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moectl.routing.gumbel import gumbel_noise


def pl_sample(logits: Tensor, k_hat: int, generator: torch.Generator | None = None) -> Tensor:
    """Ordered PL sample [..., k_hat] of expert indices from candidate logits c [..., N]."""
    if generator is None:
        u = torch.rand(logits.shape, device=logits.device)
        eps = torch.finfo(u.dtype).eps
        g = -torch.log(-torch.log(u.clamp(eps, 1 - eps)))
    else:
        g = gumbel_noise(logits.shape, generator, logits.device)
    return (logits.detach().float() + g).topk(k_hat, dim=-1).indices


def pl_log_prob(logits: Tensor, order: Tensor) -> Tensor:
    """log P_PL(i_1..i_k | c) = Σ_j [c_{i_j} − log Σ_{m ∉ {i_1..i_{j−1}}} exp c_m] (eq. 5).

    ``logits`` [..., N], ``order`` [..., k] (long); returns [...]. Vectorised over j: the j-th
    denominator is a logsumexp over c with the first j−1 picks masked out.
    """
    n = logits.shape[-1]
    onehot = torch.nn.functional.one_hot(order, n).bool()  # [..., k, N]
    taken_before = (onehot.long().cumsum(-2) - onehot.long()).bool()
    c = logits.float().unsqueeze(-2).expand(onehot.shape)
    denom = torch.logsumexp(c.masked_fill(taken_before, float("-inf")), dim=-1)  # [..., k]
    return (logits.float().gather(-1, order) - denom).sum(-1)


def mask_of(order: Tensor, n: int) -> Tensor:
    """The unordered option ω (bool [..., N]) induced by index tuples [..., k]."""
    return torch.zeros(*order.shape[:-1], n, dtype=torch.bool, device=order.device).scatter_(-1, order, True)
