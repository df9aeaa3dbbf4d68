"""Router losses: load balancing (micro-batch, data-parallel or global-batch) and router z-loss.

Load balancing (EMO §3.1, A.1):  L_LB = n_r Σ_i f_i · P_i, with f_i the fraction of tokens routed
to expert i (a token counts once for each of its k experts, so Σ f = k) and P_i the mean routing
probability. Scopes for f (P is always the local micro-batch mean, keeping its gradient):

- ``micro``: f from this micro-batch (the standard, local implementation);
- ``dp``: f all-reduced across data-parallel ranks (EMO A.1 / Qwen3: "global up to gradient
  accumulation");
- ``global``: f over the whole global batch — all ranks and all gradient-accumulation
  micro-batches (the issue's definition; the trainer gets these counts from a no-grad routing
  pass over the step's micro-batches before the backward passes).

Deviation: EMO writes f̄_i = Σ_j f_i^j (a sum over groups); we use the pooled fraction
(counts summed over groups / tokens summed over groups), which equals the local f on one rank
and keeps L_LB's scale independent of the number of ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def expert_counts(chosen: Tensor, valid: Tensor, num_experts: int) -> Tensor:
    """Tokens routed to each expert (float [E]) over valid positions of chosen [B, T, k]."""
    picked = chosen[valid]  # [N, k]
    return torch.bincount(picked.flatten(), minlength=num_experts).to(torch.float64)


def all_reduce_sum(x: Tensor) -> Tensor:
    """Sum over data-parallel ranks (identity without torch.distributed)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def load_balancing_loss(logits: Tensor, valid: Tensor, counts: Tensor, tokens: Tensor | float) -> Tensor:
    """n_r Σ_i f_i P_i for one layer: logits [B, T, E] (with graph), f = counts / tokens (constants)."""
    p = torch.softmax(logits[valid].float(), dim=-1)  # [N, E]
    mean_p = p.mean(0)
    f = (counts / tokens).to(mean_p.dtype)
    return logits.shape[-1] * (f * mean_p).sum()


def router_z_loss(logits: Tensor, valid: Tensor) -> Tensor:
    """Mean over tokens of logsumexp(router logits)² (ST-MoE), for one layer."""
    return torch.logsumexp(logits[valid].float(), dim=-1).square().mean()
