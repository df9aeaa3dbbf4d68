"""Batched log-likelihood of (context, continuation) pairs under a routed model.

Requests are tokenised as lm-eval does (context + continuation encoded together, the context's
tokens split off, trailing context spaces moved to the continuation), sorted by length so each
batch pads little, right-padded, scored in one routed forward per batch
(:func:`moectl.eval.forward.routed_log_probs`), and returned in the original order. The per-token
work is tensor code: one gather and one masked sum per batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from torch import nn

from moectl.adapters.inspect import ModelInfo
from moectl.eval.forward import (
    RequestBatch,
    RoutingPlan,
    SwitchStats,
    continuation_log_probs,
    request_keys,
    routed_log_probs,
)


@dataclass
class Scored:
    """Log-likelihood results, in request order: summed log-prob, token count, all-greedy flag."""

    logprob: torch.Tensor  # [N] float64
    tokens: torch.Tensor  # [N] long
    greedy: torch.Tensor  # [N] bool


def encode(tokenizer, text: str) -> list[int]:
    """Token ids without special tokens, for HF tokenizers and moectl's ByteTokenizer alike."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:
        return list(tokenizer.encode(text))


def encode_pair(tokenizer, context: str, continuation: str, prefix_id: int) -> tuple[list[int], list[int]]:
    """Context and continuation ids; an empty context becomes the prefix (BOS) token."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    if not context:
        return [prefix_id], encode(tokenizer, continuation)
    whole = encode(tokenizer, context + continuation)
    ctx = encode(tokenizer, context)
    return ctx, whole[len(ctx) :]


@torch.no_grad()
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
    """Summed log-probability of each continuation given its context."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    prefix = getattr(tokenizer, "bos_token_id", None)
    prefix = prefix if prefix is not None else getattr(tokenizer, "eos_token_id", 0)
    pad = getattr(tokenizer, "pad_token_id", None) or 0
    encoded = []
    for context, continuation in pairs:
        ctx, cont = encode_pair(tokenizer, context, continuation, prefix)
        if not cont:
            raise ValueError(f"empty continuation after tokenisation for context ending {context[-40:]!r}")
        seq = (ctx + cont)[-max_length:]
        encoded.append((seq, min(len(cont), len(seq) - 1)))
    order = sorted(range(len(encoded)), key=lambda i: -len(encoded[i][0]))
    device = next(model.parameters()).device
    logprob = torch.zeros(len(pairs), dtype=torch.float64)
    tokens = torch.zeros(len(pairs), dtype=torch.long)
    greedy = torch.zeros(len(pairs), dtype=torch.bool)
    columns = [TextColumn(description), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()]
    with Progress(*columns, disable=not progress, transient=True) as bar:
        task = bar.add_task(description, total=len(pairs))
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            lengths = torch.tensor([len(encoded[i][0]) for i in rows])
            conts = torch.tensor([encoded[i][1] for i in rows])
            width = int(lengths.max())
            ids = torch.full((len(rows), width), pad, dtype=torch.long)
            for r, i in enumerate(rows):  # building the padded batch, not a per-token loop
                ids[r, : lengths[r]] = torch.tensor(encoded[i][0])
            pos = torch.arange(width)[None, :]
            mask = pos < lengths[:, None]
            cont_mask = mask & (pos >= (lengths - conts)[:, None])
            ids, mask, cont_mask = ids.to(device), mask.to(device), cont_mask.to(device)
            batch = RequestBatch(ids, mask.long(), request_keys(ids, mask), "loglikelihood")
            logp = routed_log_probs(model, batch, plan, info, stats, region="all")
            total, all_greedy = continuation_log_probs(logp, ids, cont_mask)
            index = torch.tensor(rows)
            logprob[index] = total.double().cpu()
            tokens[index] = conts
            greedy[index] = all_greedy.cpu()
            bar.advance(task, len(rows))
    return Scored(logprob, tokens, greedy)
