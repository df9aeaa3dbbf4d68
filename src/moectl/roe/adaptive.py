"""Adaptive K's trade-off (beyond the paper): held-out perplexity against routing samples per token.

``ensemble.adaptive_ensemble.AdaptiveEnsemble`` runs the K−1 noisy samples only where the clean
next-token entropy exceeds a threshold. :func:`trade_off` measures held-out perplexity against
samples per token for fixed K = 1, fixed K and a range of thresholds (by default quantiles of the
clean entropy on the data).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo
from moectl.ensemble.adaptive_ensemble import AdaptiveEnsemble
from moectl.ensemble.ensemble import Ensemble
from moectl.ensemble.roe_config import RoEConfig
from moectl.errors import ConfigError
from moectl.roe.score import pad_left, scored_request, token_logprobs_stepwise
from moectl.roe.score_data import Item, LMItem


def _run(model, tokenizer, items: list[LMItem], config, threshold, batch_size, max_length, info) -> dict:
    """Teacher-forced perplexity with adaptive K at ``threshold`` (None: fixed K)."""
    seqs = [scored_request(tokenizer, i.context, i.continuation, max_length) for i in items]
    device = next(model.parameters()).device
    pad_id = getattr(tokenizer, "pad_token_id", None) or 0
    nll, tokens, samples, fed = 0.0, 0, 0.0, 0
    entropies: list[Tensor] = []
    start = time.perf_counter()
    for first in range(0, len(seqs), batch_size):
        ids, mask, scored = pad_left(seqs[first : first + batch_size], pad_id, device)
        if threshold is None:
            ens = Ensemble(model, config, info=info)
        else:
            ens = AdaptiveEnsemble(model, config, threshold, info=info)
        lp = token_logprobs_stepwise(model, ids, mask, scored, config, info, ensemble=ens)
        nll -= float((lp * scored).sum())
        tokens += int(scored.sum())
        if isinstance(ens, AdaptiveEnsemble):
            samples += ens.samples_run
            fed += ens.tokens_run
            entropies += ens.entropies
    seconds = time.perf_counter() - start
    per_token = samples / max(fed, 1) if threshold is not None else float(config.K)
    row = {
        "threshold": threshold,
        "samples_per_token": per_token,
        "noisy_fraction": (per_token - 1) / (config.K - 1) if config.K > 1 else 0.0,
        "ppl": math.exp(nll / max(tokens, 1)),
        "seconds": seconds,
    }
    if entropies:
        row["_entropies"] = torch.cat(entropies)
    return row


def trade_off(
    model: nn.Module,
    tokenizer,
    items: Sequence[Item],
    config: RoEConfig,
    thresholds: Sequence[float] | None = None,
    *,
    quantiles: Sequence[float] = (0.25, 0.5, 0.75, 0.9),
    batch_size: int = 8,
    max_length: int = 256,
    info: ModelInfo | None = None,
) -> list[dict]:
    """Perplexity vs samples per token: fixed K = 1, fixed K, adaptive K at each threshold.

    Without ``thresholds`` they are the given quantiles of the clean entropy on these items
    (measured by the threshold = ∞ run, which is K = 1 through the adaptive code path).
    """
    lm = [i for i in items if isinstance(i, LMItem)]
    if len(lm) != len(items):
        raise ConfigError(
            "adaptive K trade-off needs language-modelling items ({'text'} or {'prompt', 'continuation'})"
        )
    rows = []
    clean = _run(model, tokenizer, lm, config, math.inf, batch_size, max_length, info)
    ent = clean.pop("_entropies", torch.zeros(1))
    rows.append({"mode": "fixed K=1", **clean, "threshold": None})
    fixed = _run(model, tokenizer, lm, config, None, batch_size, max_length, info)
    rows.append({"mode": f"fixed K={config.K}", **fixed})
    if thresholds is None:
        thresholds = [float(torch.quantile(ent.float(), q)) for q in quantiles]
    for h in thresholds:
        row = _run(model, tokenizer, lm, config, float(h), batch_size, max_length, info)
        row.pop("_entropies", None)
        rows.append({"mode": f"adaptive H>{h:.4f}", **row})
    return rows
