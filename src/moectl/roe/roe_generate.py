"""RoE text generation: greedy (the paper's setting, §3.1) or sampling, B prompts × K samples per step.

Every step runs the K routing samples of each prompt's current token and aggregates their
next-token distributions (``ensemble.Ensemble``); the chosen token is then shared by all samples.
Decoding on the aggregated distribution: greedy (``temperature=0``) or sampling with temperature
and nucleus (top-p) filtering. A row finishes at EOS (unless ``ignore_eos``), at a stop string
(the text is cut before it) or after ``max_new_tokens``. ``on_text(row, piece)`` streams new text
as it is decoded (the CLI prints row 0 to the terminal).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo, inspect
from moectl.errors import ConfigError
from moectl.progress import progress_bar
from moectl.roe.ensemble import Ensemble
from moectl.roe.roe_config import RoEConfig, as_config
from moectl.routing.routing_state import Policy


@dataclass
class Generation:
    """One prompt's result. ``finish_reason``: eos | stop | length."""

    prompt: str
    text: str
    token_ids: list[int]
    finish_reason: str


@dataclass
class GenerationStats:
    """What a ``generate`` call cost: decoding steps, model forwards and wall time."""

    steps: int = 0
    forwards: int = 0
    seconds: float = 0.0
    tokens: int = 0  # generated tokens summed over prompts (up to each one's finish)
    sample_tokens: float = 0.0  # routing samples run, summed over prompts and steps
    extra: dict = field(default_factory=dict)


def choose_next(
    logprobs: Tensor, temperature: float = 0.0, top_p: float = 1.0, generator: torch.Generator | None = None
) -> Tensor:
    """Next token per row [B] from aggregated log-probs [B, V]: greedy or temperature + top-p sampling."""
    if temperature == 0.0:
        return logprobs.argmax(-1)
    logits = logprobs / temperature
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of strictly more likely tokens
        drop = before >= top_p  # keeps the smallest set whose mass reaches top_p (never empty)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logprobs.device)


def check_decoding(max_new_tokens: int, temperature: float, top_p: float) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not temperature >= 0:
        raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ConfigError(f"top_p must be in (0, 1], got {top_p}")


def _eos_ids(tokenizer) -> set[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in eos} if isinstance(eos, (list, tuple)) else {int(eos)}


def encode_batch(tokenizer, texts: Sequence[str], device: torch.device) -> tuple[Tensor, Tensor]:
    """Left-padded ``input_ids`` and ``attention_mask`` for a batch of prompts."""
    side = getattr(tokenizer, "padding_side", "left")
    if side != "left":
        tokenizer.padding_side = "left"
    try:
        enc = tokenizer(list(texts), return_tensors="pt", padding=True)
    finally:
        if side != "left":
            tokenizer.padding_side = side
    ids, mask = enc["input_ids"], enc["attention_mask"]
    if ids.shape[1] == 0:
        raise ConfigError("the prompts encode to no tokens")
    return ids.to(device), mask.to(device)


def _stream_piece(text: str, shown: str, stop: Sequence[str], final: bool) -> tuple[str, str]:
    """(new piece to print, text shown after it). Unless ``final``, holds back a tail that may still
    become a stop string or is an incomplete UTF-8 character (decoded as U+FFFD)."""
    visible = text
    if not final:
        hold = max((n for s in stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        visible = text[: len(text) - hold].rstrip("\ufffd")
    if len(visible) > len(shown) and visible.startswith(shown):
        return visible[len(shown) :], visible
    return "", shown


def _cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


@torch.no_grad()
def generate(
    model: nn.Module,
    tokenizer,
    prompts: str | Sequence[str],
    config: RoEConfig | str | Path | dict | None = None,
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    batch_size: int = 8,
    sample_seed: int = 0,
    on_text: Callable[[int, str], None] | None = None,
    progress: bool = False,
    policies: Sequence[Policy] = (),
    info: ModelInfo | None = None,
    adaptive_threshold: float | None = None,
    stats: GenerationStats | None = None,
) -> list[Generation]:
    """Generate from ``prompts`` with RoE (``config``: K, tau, aggregation, cache; default K=16, tau=0).

    ``adaptive_threshold`` (nats, clean cache only): spend the K−1 noisy samples only on tokens
    whose clean next-token entropy exceeds it (``adaptive.AdaptiveEnsemble``; beyond the paper).
    ``on_text(row, piece)`` receives newly decoded text of the prompt at index ``row``.
    Pass a ``GenerationStats`` to have it filled. ``config`` may be a tau profile (path or dict).
    """
    config = as_config(config)
    check_decoding(max_new_tokens, temperature, top_p)
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not texts:
        raise ConfigError("no prompts given")
    stop = [s for s in stop if s]
    info = info or inspect(model)
    device = next(model.parameters()).device
    eos_ids = set() if ignore_eos else _eos_ids(tokenizer)
    pad_id = getattr(tokenizer, "pad_token_id", None) or 0
    generator = torch.Generator().manual_seed(sample_seed)
    stats = stats if stats is not None else GenerationStats()
    results: list[Generation] = []
    start_time = time.perf_counter()
    with progress_bar("RoE K={task.fields[k]}", progress) as bar:
        task = bar.add_task("gen", total=len(texts) * max_new_tokens, k=config.K)
        for first in range(0, len(texts), batch_size):
            batch = texts[first : first + batch_size]
            ids, mask = encode_batch(tokenizer, batch, device)
            if adaptive_threshold is not None:
                from moectl.roe.adaptive import AdaptiveEnsemble

                ensemble = AdaptiveEnsemble(model, config, adaptive_threshold, info=info, policies=policies)
            else:
                ensemble = Ensemble(model, config, info=info, policies=policies)
            results += _decode_batch(
                ensemble, tokenizer, batch, ids, mask, first, max_new_tokens, temperature, top_p, stop,
                eos_ids, pad_id, generator, on_text, stats, lambda n: bar.advance(task, n),
            )  # fmt: skip
    stats.seconds += time.perf_counter() - start_time
    return results


def _decode_batch(
    ensemble: Ensemble,
    tokenizer,
    batch: list[str],
    ids: Tensor,
    mask: Tensor,
    first_row: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    stop: list[str],
    eos_ids: set[int],
    pad_id: int,
    generator: torch.Generator,
    on_text: Callable[[int, str], None] | None,
    stats: GenerationStats,
    advance: Callable[[int], None],
) -> list[Generation]:
    """The autoregressive loop for one batch of prompts (the only per-token Python loop)."""
    b = ids.shape[0]
    device = ids.device
    finished = torch.zeros(b, dtype=torch.bool, device=device)
    reasons = ["length"] * b
    produced: list[Tensor] = []
    shown = [""] * b
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)
    watch_text = bool(stop) or on_text is not None
    with ensemble:
        out = ensemble.start(ids, mask)
        stats.forwards += 1
        for step in range(max_new_tokens):
            active = int((~finished).sum())
            stats.sample_tokens += ensemble.last_samples * active
            token = choose_next(out.logprobs, temperature, top_p, generator)
            token = torch.where(finished, torch.full_like(token, pad_id), token)
            produced.append(token)
            stats.tokens += int((~finished).sum())
            hit_eos = torch.isin(token, eos) & ~finished
            for row in hit_eos.nonzero().flatten().tolist():
                reasons[row] = "eos"
            finished |= hit_eos
            if watch_text:
                new = torch.stack(produced, 1)
                last = step == max_new_tokens - 1
                for row in (~finished | hit_eos).nonzero().flatten().tolist():
                    text, stopped = _cut_at_stop(_decode(tokenizer, new[row], eos_ids, pad_id), stop)
                    if stopped:
                        reasons[row] = "stop"
                        finished[row] = True
                    if on_text is not None:
                        piece, shown[row] = _stream_piece(text, shown[row], stop, bool(finished[row]) or last)
                        if piece:
                            on_text(first_row + row, piece)
            advance(b)
            stats.steps += 1
            if bool(finished.all()) or step == max_new_tokens - 1:
                break
            out = ensemble.step(token)
            stats.forwards += 1
    new = torch.stack(produced, 1) if produced else ids.new_zeros(b, 0)
    results = []
    for row in range(b):
        row_ids = _until_finish(new[row], eos_ids, pad_id, reasons[row])
        text, _ = _cut_at_stop(_decode(tokenizer, row_ids, eos_ids, pad_id), stop)
        results.append(Generation(batch[row], text, row_ids.tolist(), reasons[row]))
    return results


def _until_finish(row: Tensor, eos_ids: set[int], pad_id: int, reason: str) -> Tensor:
    if reason == "eos":
        hits = torch.isin(row, torch.tensor(sorted(eos_ids), device=row.device)).nonzero()
        return row[: int(hits[0]) + 1] if len(hits) else row
    return row


def _decode(tokenizer, ids: Tensor, eos_ids: set[int], pad_id: int) -> str:
    keep = ids[~torch.isin(ids, torch.tensor(sorted(eos_ids | {pad_id}), device=ids.device))]
    return tokenizer.decode(keep.tolist(), skip_special_tokens=True)
