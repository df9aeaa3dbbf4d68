"""RoE log-likelihood of given continuations: perplexity and multiple-choice accuracy (RoE §2.2.1, §3.1).

The RoE probability of token x_t is the aggregated distribution of the K routing samples that
predict it from the clean prefix x_<t (the clean-cache definition, §2.3):

    p_RoE(x_t | x_<t) = agg_k p_k(x_t | clean prefix, noisy routing of x_{t-1} in sample k)

Two ways to compute it, with the same Gumbel draws and therefore the same numbers:

``parallel`` (clean cache, attention-only models; the default there)
    One clean forward over the whole sequence fills a KV cache; one forward of the noisy samples
    (K−1 rows per sequence, in chunks) reads it: at every position t a noisy row sees the clean
    keys before t and its own key t only (``masks.teacher_forced_masks``). All positions in two
    forwards — "a single forward pass over the validation set" in spirit (§2.2.1).
``stepwise`` (any cache variant, hybrid models)
    Teacher-forced decoding with ``Ensemble``: one ensemble step per position.

Perplexity is exp of the mean negative log-likelihood over scored tokens. For multiple choice the
prediction is the choice with the highest summed log-probability (§3.1, following Hu et al.).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo, inspect
from moectl.ensemble.ensemble import Ensemble
from moectl.ensemble.masks import attention_kinds
from moectl.ensemble.roe_config import RoEConfig, as_config
from moectl.errors import ConfigError
from moectl.lm.padding import left_pad, scored_positions
from moectl.models.tokens import encode, request
from moectl.progress import progress_bar
from moectl.roe.parallel import RoEScoringInputs, parallel_token_logprobs
from moectl.roe.roe_generate import generate
from moectl.roe.score_data import ChoiceItem, GenItem, Item, LMItem, item_kind, load_items
from moectl.routing.routing_state import Policy


# -- tokens ---------------------------------------------------------------------------------
def pad_left(
    seqs: Sequence[tuple[list[int], int]], pad_id: int, device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    """(ids [B, L], attention mask [B, L], scored [B, L] bool) for sequences with their first scored index."""
    ids, mask = left_pad([s for s, _ in seqs], pad_id, device)
    return ids, mask, scored_positions(mask, [first for _, first in seqs])


def scored_request(tokenizer, context: str, continuation: str, max_length: int) -> tuple[list[int], int]:
    """Token ids of context + continuation (``moectl.models.tokens.request``, the one tokenisation of
    every moectl scorer) and the index of the first scored token."""
    ids, scored = request(tokenizer, context, continuation, max_length)
    return ids, len(ids) - scored


# -- RoE token log-probabilities ------------------------------------------------------------
@torch.no_grad()
def token_logprobs_parallel(
    model: nn.Module,
    ids: Tensor,
    mask: Tensor,
    config: RoEConfig,
    info: ModelInfo | None = None,
    policies: Sequence[Policy] = (),
) -> Tensor:
    """RoE log p(x_t | x_<t) [B, L] for every position (0 at position 0), clean cache, without [K, L, V]."""
    return parallel_token_logprobs(RoEScoringInputs(model, ids, mask, config, info, policies)) * mask.bool()


@torch.no_grad()
def token_logprobs_stepwise(
    model: nn.Module,
    ids: Tensor,
    mask: Tensor,
    scored: Tensor,
    config: RoEConfig,
    info: ModelInfo | None = None,
    ensemble: Ensemble | None = None,
) -> Tensor:
    """RoE log p(x_t | x_<t) [B, L] by teacher-forced ensemble steps (any cache variant)."""
    b, length = ids.shape
    first = int(scored.float().argmax(1)[scored.any(1)].min()) if bool(scored.any()) else length
    lp = torch.zeros(b, length, device=ids.device)
    if first >= length:
        return lp
    first = max(first, 1)
    valid = mask.bool()
    ens = ensemble or Ensemble(model, config, info=info)
    with ens:
        out = ens.start(ids[:, :first], mask[:, :first])
        for t in range(first, length):
            lp[:, t] = out.logprobs.gather(-1, ids[:, t : t + 1]).squeeze(-1)
            if t < length - 1:
                out = ens.step(ids[:, t], valid[:, t])
    return lp * valid


def token_logprobs(
    model: nn.Module,
    ids: Tensor,
    mask: Tensor,
    scored: Tensor,
    config: RoEConfig,
    info: ModelInfo | None = None,
    method: str = "auto",
) -> Tensor:
    """RoE log-probabilities [B, L] of each token given its prefix; 0 where not ``scored``.

    ``method``: ``auto`` (parallel for the clean cache on attention-only models, else
    stepwise), ``parallel`` or ``stepwise``.
    """
    if method not in ("auto", "parallel", "stepwise"):
        raise ConfigError(f"method must be auto, parallel or stepwise, got {method!r}")
    if method == "auto":
        recurrent = any(k.kind == "recurrent" for k in attention_kinds(model.config)[0])
        method = "parallel" if config.cache == "clean" and not recurrent else "stepwise"
    if method == "parallel":
        if config.cache != "clean":
            raise ConfigError(f"the parallel scoring path is the clean cache; got cache={config.cache!r}")
        lp = token_logprobs_parallel(model, ids, mask, config, info)
    else:
        lp = token_logprobs_stepwise(model, ids, mask, scored, config, info)
    return lp * scored


# -- datasets ------------------------------------------------------------------------------
@dataclass
class ScoreResult:
    """What ``score`` measured. ``loglik`` is per LM item, or per (item, choice) for multiple choice."""

    kind: str
    items: int
    tokens: int
    nll: float  # summed negative log-likelihood (nats) of the scored tokens
    seconds: float
    loglik: list[float] = field(default_factory=list)
    predictions: list[int] = field(default_factory=list)
    accuracy: float | None = None

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / max(self.tokens, 1))

    def summary(self) -> dict:
        out = {
            "kind": self.kind,
            "items": self.items,
            "tokens": self.tokens,
            "nll_per_token": self.nll / max(self.tokens, 1),
        }
        out["ppl"] = self.ppl
        if self.accuracy is not None:
            out["accuracy"] = self.accuracy
        out["seconds"] = self.seconds
        return out


def score(
    model: nn.Module,
    tokenizer,
    data: str | Path | Sequence[Item | str],
    config: RoEConfig | str | Path | dict | None = None,
    *,
    batch_size: int = 8,
    max_length: int = 512,
    method: str = "auto",
    limit: int | None = None,
    progress: bool = False,
    info: ModelInfo | None = None,
) -> ScoreResult:
    """RoE log-likelihood of a dataset: perplexity (LM items), accuracy (multiple choice or generation).

    ``data`` is a JSONL path (see ``moectl.roe.score_data``) or a list of items; a plain string in the
    list is a text scored whole (``LMItem("", text)``). ``config`` is a RoEConfig, or a tau profile
    (path or dict) that ``moectl.load_policy`` reads; None: K = 16, tau = 0.
    """
    config = as_config(config)
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    if max_length < 2:
        raise ConfigError(f"max_length must be >= 2, got {max_length}")
    if isinstance(data, (str, Path)):
        items = load_items(data, limit)
    else:
        items = [LMItem("", x) if isinstance(x, str) else x for x in list(data)[:limit]]
    if not items:
        raise ConfigError("no items to score")
    kind = item_kind(items)
    info = info or inspect(model)
    start = time.perf_counter()
    if kind == "gen":
        return _exact_match(model, tokenizer, items, config, batch_size, progress, info, start)
    pairs: list[tuple[str, str]] = []
    owner: list[int] = []
    for n, item in enumerate(items):
        if isinstance(item, ChoiceItem):
            pairs += [(item.context, choice) for choice in item.choices]
            owner += [n] * len(item.choices)
        else:
            assert isinstance(item, LMItem)
            pairs.append((item.context, item.continuation))
            owner.append(n)
    seqs = [scored_request(tokenizer, c, x, max_length) for c, x in pairs]
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i][0]))  # similar lengths share a batch
    device = next(model.parameters()).device
    pad_id = getattr(tokenizer, "pad_token_id", None) or 0
    loglik = [0.0] * len(seqs)
    counts = [0] * len(seqs)
    with progress_bar(f"scoring K={config.K}", progress) as bar:
        task = bar.add_task("score", total=len(seqs))
        for first in range(0, len(order), batch_size):
            chunk = order[first : first + batch_size]
            ids, mask, scored = pad_left([seqs[i] for i in chunk], pad_id, device)
            lp = token_logprobs(model, ids, mask, scored, config, info, method)
            for row, i in enumerate(chunk):
                loglik[i] = float(lp[row].sum())
                counts[i] = int(scored[row].sum())
            bar.advance(task, len(chunk))
    result = ScoreResult(kind, len(items), 0, 0.0, 0.0, loglik)
    if kind == "lm":
        result.tokens, result.nll = sum(counts), -sum(loglik)
    else:
        by_item: dict[int, list[int]] = {}
        for pair, n in enumerate(owner):
            by_item.setdefault(n, []).append(pair)
        preds = [max(range(len(p)), key=lambda j, p=p: loglik[p[j]]) for p in by_item.values()]
        gold = [items[n].answer for n in by_item]  # type: ignore[union-attr]
        correct = [by_item[n][items[n].answer] for n in by_item]  # type: ignore[union-attr]
        result.predictions = preds
        result.accuracy = sum(int(p == g) for p, g in zip(preds, gold, strict=True)) / len(preds)
        result.tokens = sum(counts[c] for c in correct)
        result.nll = -sum(loglik[c] for c in correct)
    result.seconds = time.perf_counter() - start
    return result


def _exact_match(model, tokenizer, items, config, batch_size, progress, info, start) -> ScoreResult:
    assert all(isinstance(i, GenItem) for i in items)
    longest = max(len(encode(tokenizer, i.answer)) for i in items)
    outs = generate(
        model, tokenizer, [i.prompt for i in items], config,
        max_new_tokens=longest + 2, batch_size=batch_size, progress=progress, info=info,
    )  # fmt: skip
    hits = [o.text.strip().startswith(i.answer.strip()) for o, i in zip(outs, items, strict=True)]
    result = ScoreResult("gen", len(items), 0, 0.0, 0.0, predictions=[int(h) for h in hits])
    result.accuracy = sum(hits) / len(hits)
    result.seconds = time.perf_counter() - start
    return result
