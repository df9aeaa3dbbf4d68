"""The row a training step adds to TE-MoE's training curves (§5, Fig. 5; A3), and prompt tokenisation.

A row holds the mean reward, the switch rate (per layer too), the mean, P95 and standard deviation
of the switch probability β, the critics' loss, the mean deliberation cost η_t charged and the mean
experts a switch brought in, the repetition rate of the samples (A3), the teacher's perplexity of
the samples, both losses, the tokens and the seconds of the step. Means over the batch go through
``total`` (the sum over data-parallel ranks; identity alone), so every process writes the row of
the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from moectl.errors import ConfigError
from moectl.options.rollout import Rollout


def _same(x: Tensor) -> Tensor:
    return x


def tokenize_prompts(tokenizer, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """Token ids of each prompt, cut to ``max_tokens``; prompts without a token are left out."""
    out = []
    for text in prompts:
        ids = tokenizer.encode(text, verbose=False)[:max_tokens]
        if ids:
            out.append(list(ids))
    if not out:
        raise ConfigError("no prompt produced any token")
    return out


def repetition_rates(roll: Rollout) -> list[float]:
    """1 − unique-token fraction of each sampled continuation that has a token (A3)."""
    rates = []
    for row, valid in zip(roll.actions.tolist(), roll.valid.tolist(), strict=True):
        tokens = [a for a, v in zip(row, valid, strict=True) if v]  # host lists: a few hundred ints
        if tokens:
            rates.append(1.0 - len(set(tokens)) / len(tokens))
    return rates


def repetition_rate(roll: Rollout) -> float:
    """The mean repetition rate of the batch's continuations (A3)."""
    rates = repetition_rates(roll)
    return sum(rates) / max(len(rates), 1)


def step_row(
    step: int,
    roll: Rollout,
    stats: dict[str, Any],
    loss_controller: Tensor,
    loss_intra: Tensor,
    seconds: float,
    total: Callable[[Tensor], Tensor] = _same,
) -> dict[str, Any]:
    """The step's row of ``log.jsonl`` (the curves :func:`moectl.reporting.option_plots.plot_curves` draws)."""
    device = roll.rewards.device
    valid = roll.valid.float()
    n = total(valid.sum()).clamp(min=1)
    rates = repetition_rates(roll)
    repeated = total(torch.tensor([sum(rates), len(rates)], dtype=torch.float64, device=device))
    return {
        "step": step,
        "reward": float(total((roll.rewards * valid).sum()) / n),
        "switch_rate": stats["switch_rate"],
        "switch_prob_mean": stats["beta_mean"],
        "switch_prob_p95": stats["beta_p95"],
        "switch_prob_std": stats["beta_std"],
        "value_loss": stats["value_loss"],
        "eta_mean": stats["eta_mean"],  # mean η_t of the termination advantages (nats)
        "n_new_mean": stats["n_new_mean"],  # mean experts a switch brought in
        "repetition_rate": float(repeated[0]) / max(float(repeated[1]), 1.0),
        "teacher_ppl": float(torch.exp(-total((roll.logp_teacher * valid).sum()) / n)),
        "controller_loss": float(total(loss_controller.detach().to(device))),
        "intra_loss": float(total(loss_intra.detach().to(device))),
        "tokens": int(n),
        "seconds": seconds,
        "switch_rate_per_layer": stats["switch_rate_per_layer"],
    }
