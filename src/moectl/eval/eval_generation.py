"""Generation until stop strings under a routing plan: lm-eval's ``generate_until`` over moectl.

Contexts are encoded without special tokens (an empty one is the prefix token), left-truncated
to leave room for ``max_gen_toks``, put in a canonical order (longest first, then by tokens),
left-padded and decoded in batches. Each step chooses from next-token log-probabilities [B, V]
of the last position only:

- plain or policy routing: the routed model with its KV cache (``repeats = K``: K routed copies
  per request, their distributions averaged in probability space, one shared token stream);
- RoE (``routing.roe``): ``moectl.roe.Ensemble`` — K routing samples per token over one clean
  cache (RoE §2.3), as ``moectl roe generate`` decodes.

Greedy unless ``temperature > 0`` (lm-eval's ``do_sample``); sampling uses the Gumbel-max trick
with draws keyed by (seed, request, step), so a request samples the same text in any batch.
Rows stop at EOS or once their text holds a stop string; the text is cut before the first stop
string, as lm-eval cuts it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo
from moectl.engine.batch import left_pad
from moectl.errors import ConfigError
from moectl.eval.forward import BatchRouting, RequestBatch, RoutingPlan, SwitchStats, request_keys
from moectl.eval.request_noise import (
    hashed_uniform,
    needs_isolation,
    request_codes,
    reseed,
    set_request_codes,
)
from moectl.models.tokens import encode, prefix_token
from moectl.routing.kv_cache import cache_out, with_cache
from moectl.routing.session import route

Step = Callable[[Tensor], Tensor]  # next token [B] -> next-token log-probabilities [B, V]


@dataclass(frozen=True)
class GenSettings:
    """What to generate: at most ``max_gen_toks`` tokens, stopping at any of ``until``;
    greedy for ``temperature == 0``, else sampling (with nucleus ``top_p``)."""

    until: Sequence[str] = field(default_factory=tuple)
    max_gen_toks: int = 256
    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.max_gen_toks, int) or self.max_gen_toks < 1:
            raise ConfigError(f"max_gen_toks must be an integer >= 1, got {self.max_gen_toks!r}")
        if not self.temperature >= 0:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")


def _eos_ids(tokenizer) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


def choose(logp: Tensor, settings: GenSettings, codes: Tensor, step: int, seed: int) -> Tensor:
    """Next token [B]: argmax, or a sample by Gumbel-max with draws keyed by (seed, request, step)."""
    if settings.temperature == 0:
        return logp.argmax(-1)
    logits = logp.float() / settings.temperature
    if settings.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = (probs.cumsum(-1) - probs) >= settings.top_p  # keeps the smallest set reaching top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, -math.inf))
    position = torch.full((logp.shape[0], 1), step, dtype=torch.long, device=logp.device)
    u = hashed_uniform(codes.to(logp.device), position, seed, logp.shape[-1])[:, 0]
    return (logits - torch.log(-torch.log(u))).argmax(-1)


def _text(tokenizer, ids: list[int], until: Sequence[str]) -> tuple[str, bool]:
    """The decoded text cut before the first stop string, and whether one was found."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    hits = [i for i in (text.find(s) for s in until if s) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def decode(
    first: Tensor, step: Step, tokenizer, settings: GenSettings, codes: Tensor, seed: int
) -> list[str]:
    """Texts decoded from next-token log-probs: ``first`` [B, V] after the context, ``step(token)`` after each token."""
    b = first.shape[0]
    eos = torch.tensor(_eos_ids(tokenizer), dtype=torch.long, device=first.device)
    pad = getattr(tokenizer, "pad_token_id", None) or 0
    done = torch.zeros(b, dtype=torch.bool)
    produced: list[list[int]] = [[] for _ in range(b)]
    logp = first
    for n in range(settings.max_gen_toks):  # the autoregressive loop: one step per generated token
        token = choose(logp, settings, codes, n, seed)
        hit_eos = torch.isin(token, eos).cpu()
        for row in (~done & ~hit_eos).nonzero().flatten().tolist():  # stop strings: per active row
            produced[row].append(int(token[row]))
            done[row] = _text(tokenizer, produced[row], settings.until)[1]
        done |= hit_eos
        if bool(done.all()) or n == settings.max_gen_toks - 1:
            break
        logp = step(torch.where(done.to(token.device), torch.full_like(token, pad), token))
    return [_text(tokenizer, ids, settings.until)[0] for ids in produced]


@contextmanager
def routed_steps(
    model: nn.Module, batch: RequestBatch, routing: BatchRouting, info: ModelInfo, stats: SwitchStats | None
) -> Iterator[tuple[Tensor, Step]]:
    """(first log-probs [B, V], step) of the routed model with its KV cache, K copies per request
    averaged in probability space (one shared token stream); the routing stays on inside."""
    k, b = int(routing.repeats), batch.size
    mask = batch.attention_mask.repeat_interleave(k, 0).long()
    past = None

    def forward(ids: Tensor) -> Tensor:
        nonlocal past
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1] :]
        out = model(
            input_ids=ids, attention_mask=mask, position_ids=positions, **with_cache(past),
            use_cache=True, logits_to_keep=1,
        )  # fmt: skip
        past = cache_out(out)
        logp = F.log_softmax(out.logits[:, -1].float(), dim=-1).view(b, k, -1)
        return logp[:, 0] if k == 1 else torch.logsumexp(logp, dim=1) - math.log(k)

    def step(token: Tensor) -> Tensor:
        nonlocal mask
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        return forward(token.repeat_interleave(k)[:, None])

    set_request_codes(routing.policies, batch.keys, k)
    with (
        torch.no_grad(),
        route(model, list(routing.policies), record=stats is not None, info=info) as session,
    ):
        yield forward(batch.input_ids.repeat_interleave(k, 0)), step
    if stats is not None:
        stats.add(session.trace, "generated")


@contextmanager
def roe_steps(
    model: nn.Module, batch: RequestBatch, routing: BatchRouting, info: ModelInfo
) -> Iterator[tuple[Tensor, Step]]:
    """(first log-probs [B, V], step) of Roster of Experts (RoE §2.3): K samples per token, clean cache."""
    from moectl.roe.ensemble import Ensemble

    assert routing.roe is not None
    set_request_codes(routing.policies, batch.keys)
    with torch.no_grad(), Ensemble(model, routing.roe, info=info, policies=list(routing.policies)) as ens:
        yield (
            ens.start(batch.input_ids, batch.attention_mask).logprobs,
            lambda token: ens.step(token).logprobs,
        )


def _generate_batch(
    model: nn.Module,
    tokenizer,
    batch: RequestBatch,
    plan: RoutingPlan,
    info: ModelInfo,
    settings: GenSettings,
    seed: int,
    stats: SwitchStats | None,
) -> list[str]:
    routing = plan(batch)
    codes = request_codes(batch.keys, seed)
    if routing.roe is not None:
        with roe_steps(model, batch, routing, info) as (first, step):
            return decode(first, step, tokenizer, settings, codes, seed)
    if batch.size > 1 and any(needs_isolation(p) for p in routing.policies):
        out = []
        for r in range(batch.size):  # one request per forward: policies whose draws cannot be keyed
            keep = batch.attention_mask[r].bool()
            one = RequestBatch(batch.input_ids[r : r + 1, keep], batch.attention_mask[r : r + 1, keep],
                               [batch.keys[r]], batch.kind)  # fmt: skip
            out += _generate_batch(model, tokenizer, one, plan, info, settings, seed, stats)
        return out
    if batch.size == 1:
        reseed(routing.policies, batch.keys[0])
    with routed_steps(model, batch, routing, info, stats) as (first, step):
        return decode(first, step, tokenizer, settings, codes, seed)


@torch.no_grad()
def generate_texts(
    model: nn.Module,
    tokenizer,
    contexts: Sequence[str],
    settings: GenSettings,
    plan: RoutingPlan,
    info: ModelInfo,
    batch_size: int = 8,
    max_length: int = 2048,
    seed: int = 1234,
    stats: SwitchStats | None = None,
) -> list[str]:
    """The generated text of each context, in order (see the module doc)."""
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    room = max_length - settings.max_gen_toks
    if room < 1:
        raise ConfigError(
            f"max_gen_toks = {settings.max_gen_toks} leaves no room for the context in max_length = {max_length}"
        )
    encoded = [(encode(tokenizer, c) or [prefix_token(tokenizer)])[-room:] for c in contexts]
    order = sorted(range(len(encoded)), key=lambda i: (-len(encoded[i]), encoded[i]))
    device = next(model.parameters()).device
    pad = getattr(tokenizer, "pad_token_id", None) or 0
    texts: list[str] = [""] * len(contexts)
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        ids, mask = left_pad([encoded[i] for i in rows], pad, device)
        batch = RequestBatch(ids, mask, request_keys(ids, mask), "generate")
        for i, text in zip(rows, _generate_batch(model, tokenizer, batch, plan, info, settings, seed, stats),
                           strict=True):  # fmt: skip
            texts[i] = text
    return texts
