"""RoE text generation: greedy (the paper's setting, §3.1) or sampling, B prompts × K samples per step.

Runs through the engine (``moectl.engine``): the config is registered as one RoE routing, and the
engine decodes its requests together — one ensemble for the batch (``engine.roe_rows``), K routing
samples of each prompt's current token aggregated into one next-token distribution
(``ensemble.Ensemble``), the chosen token shared by all samples — with rows joining and leaving
at step boundaries (``batch_size`` is the engine's ``max_batch``). Decoding on the aggregated
distribution: greedy (``temperature=0``) or sampling with temperature and nucleus (top-p)
filtering (``engine.sampling.choose_tokens``: prompt i draws with seed ``sample_seed + i``, keyed
by its own token index, so its text does not depend on the other prompts). A row finishes at EOS
(unless ``ignore_eos``), at a stop string (the text is cut before it) or after
``max_new_tokens``. ``on_text(row, piece)`` streams new text as it is decoded (the CLI prints
row 0 to the terminal).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from torch import nn

from moectl.adapters.inspect import ModelInfo
from moectl.engine.engine import Engine, EngineConfig, Event
from moectl.engine.sampling import SamplingParams
from moectl.ensemble.roe_config import RoEConfig, as_config
from moectl.errors import ConfigError
from moectl.routing.routing_state import Policy

ROUTING = "roe"  # the name ``generate`` registers its config under in its engine


@dataclass
class Generation:
    """One prompt's result. ``finish_reason``: eos | stop | length."""

    prompt: str
    text: str
    token_ids: list[int]
    finish_reason: str


@dataclass
class GenerationStats:
    """What a ``generate`` call cost: decoding steps (ensemble forwards: a prefill or a step of the batch,
    each giving every row in it its next token), model forwards and wall time."""

    steps: int = 0
    forwards: int = 0
    seconds: float = 0.0
    tokens: int = 0  # generated tokens summed over prompts (up to each one's finish)
    sample_tokens: float = 0.0  # routing samples run, summed over prompts and steps
    extra: dict = field(default_factory=dict)


def check_decoding(max_new_tokens: int, temperature: float, top_p: float) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not temperature >= 0:
        raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ConfigError(f"top_p must be in (0, 1], got {top_p}")


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
    whose clean next-token entropy exceeds it (``ensemble.adaptive_ensemble.AdaptiveEnsemble``;
    beyond the paper).
    ``on_text(row, piece)`` receives newly decoded text of the prompt at index ``row``.
    ``sample_seed``: prompt i samples with seed ``sample_seed + i`` (with ``temperature > 0``).
    ``policies`` route before the RoE noise (e.g. an ``ExpertMask``). Pass a ``GenerationStats``
    to have it filled. ``config`` may be a tau profile (path or dict).
    """
    config = as_config(config)
    check_decoding(max_new_tokens, temperature, top_p)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    if adaptive_threshold is not None:
        if config.cache != "clean":
            raise ConfigError(f"adaptive K runs on the clean cache; got cache={config.cache!r}")
        if not adaptive_threshold >= 0:
            raise ConfigError(
                f"adaptive K: the entropy threshold must be >= 0 nats, got {adaptive_threshold}"
            )
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not texts:
        raise ConfigError("no prompts given")
    params = SamplingParams(
        max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=sample_seed,
        stop=tuple(s for s in stop if s), ignore_eos=ignore_eos,
    )  # fmt: skip
    engine = Engine(
        model,
        tokenizer,
        EngineConfig(max_batch=batch_size, max_queue=len(texts)),
        {ROUTING: config},
        info=info,
    )
    engine.routings[ROUTING] = replace(
        engine.routings[ROUTING], policies=list(policies), adaptive=adaptive_threshold
    )

    def on_event(row: int, event: Event) -> None:
        if on_text is not None and event.text:
            on_text(row, event.text)

    stats = stats if stats is not None else GenerationStats()
    start_time = time.perf_counter()
    done = engine.generate(texts, params, ROUTING, progress=progress, seed_per_prompt=True, on_event=on_event)
    stats.seconds += time.perf_counter() - start_time
    counters = engine.counters
    stats.steps += counters.get("roe_forwards", 0)
    stats.forwards += counters.get("roe_forwards", 0)
    stats.tokens += counters["generated_tokens"]
    stats.sample_tokens += counters.get("roe_sample_tokens", 0.0)
    return [_generation(text, c) for text, c in zip(texts, done, strict=True)]


def _generation(prompt: str, completion) -> Generation:
    """A finished engine request as a ``Generation`` (an EOS token ends its ``token_ids``)."""
    ids = list(completion.token_ids)
    reason = completion.finish_reason
    if completion.stop_token is not None:
        ids.append(completion.stop_token)
        reason = "eos"
    return Generation(prompt, completion.text, ids, reason)
