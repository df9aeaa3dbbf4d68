"""Batched log-likelihood of token requests under a routed model: every evaluator's scoring loop.

A request is ``(ids, scored)`` (``moectl.models.tokens``: the one tokenisation of (context,
continuation) pairs and of documents). Requests are put in a canonical order — longest first,
then by their tokens — so a batch holds the same requests whatever order they came in; each
batch is right-padded and scored by :func:`moectl.eval.token_scores.routed_token_scores` (the LM
head on chunks of positions), and the results go back in request order. Routing randomness is
keyed by request (``request_noise.py``), so batch size and order do not change a score either.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from moectl.adapters.inspect import ModelInfo
from moectl.errors import ConfigError
from moectl.eval.forward import RequestBatch, RoutingPlan, SwitchStats, request_keys
from moectl.eval.token_scores import routed_token_scores, sum_scores
from moectl.models.tokens import Request, request
from moectl.progress import progress_bar


@dataclass
class Scored:
    """Log-likelihood results, in request order: summed log-prob, token count, all-greedy flag."""

    logprob: torch.Tensor  # [N] float64
    tokens: torch.Tensor  # [N] long
    greedy: torch.Tensor  # [N] bool


def canonical_order(requests: Sequence[Request]) -> list[int]:
    """Request indices, longest first, ties by token ids: the same batches for any input order."""
    return sorted(range(len(requests)), key=lambda i: (-len(requests[i][0]), requests[i][0]))


@torch.no_grad()
def score_requests(
    model: nn.Module,
    requests: Sequence[Request],
    plan: RoutingPlan,
    info: ModelInfo,
    batch_size: int = 8,
    stats: SwitchStats | None = None,
    progress: bool = True,
    description: str = "scoring",
) -> Scored:
    """Summed log-probability of the last ``scored`` tokens of each request's ``ids``."""
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    device = next(model.parameters()).device
    logprob = torch.zeros(len(requests), dtype=torch.float64)
    tokens = torch.zeros(len(requests), dtype=torch.long)
    greedy = torch.ones(len(requests), dtype=torch.bool)
    order = canonical_order(requests)
    with progress_bar(description, progress) as bar:
        task = bar.add_task(description, total=len(requests))
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            lengths = torch.tensor([len(requests[i][0]) for i in rows])
            counts = torch.tensor([requests[i][1] for i in rows])
            ids = torch.zeros((len(rows), int(lengths.max())), dtype=torch.long)
            for r, i in enumerate(rows):  # building the padded batch, not a per-token loop
                ids[r, : lengths[r]] = torch.tensor(requests[i][0])
            pos = torch.arange(ids.shape[1])[None, :]
            mask = pos < lengths[:, None]
            scored = mask & (pos >= (lengths - counts)[:, None])
            ids, mask, scored = ids.to(device), mask.to(device), scored.to(device)
            batch = RequestBatch(ids, mask.long(), request_keys(ids, mask), "loglikelihood")
            scores = routed_token_scores(model, batch, plan, info, scored, stats, region="all")
            total, all_greedy = sum_scores(scores, scored)
            index = torch.tensor(rows)
            logprob[index] = total.cpu()
            tokens[index] = counts
            greedy[index] = all_greedy.cpu()
            bar.advance(task, len(rows))
    return Scored(logprob, tokens, greedy)


def score_pairs(
    model: nn.Module,
    tokenizer,
    pairs: Sequence[tuple[str, str]],
    plan: RoutingPlan,
    info: ModelInfo,
    batch_size: int = 8,
    max_length: int = 2048,
    stats: SwitchStats | None = None,
    progress: bool = True,
    description: str = "scoring",
) -> Scored:
    """Summed log-probability of each continuation given its context (lm-eval's ``loglikelihood``)."""
    requests = [request(tokenizer, context, continuation, max_length) for context, continuation in pairs]
    return score_requests(model, requests, plan, info, batch_size, stats, progress, description)
