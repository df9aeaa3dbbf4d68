"""A request's state in the engine, and what it hands back: events while it runs, a completion at its end.

``Request`` is one submitted prompt's state from the queue to its finish (its tokens, text stream,
log-probabilities, trace, switch count); ``Chunked`` a request whose long prompt is prefilled a
chunk per step. ``Event`` (one per generated token, streamed) and ``Completion`` (the end, as
``Engine.generate`` returns it) are what callers see (``output.py`` makes them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from moectl.engine.logprobs import TokenLogprob
from moectl.engine.routings import Routing
from moectl.engine.sampling import SamplingParams
from moectl.engine.text import TextStream


@dataclass
class Event:
    """What a request produced in one step: one event per generated token (``token_ids``, its id), with
    the text completed at that step — empty while the text is held back (an incomplete UTF-8
    character, a possible start of a stop string), so ``text`` concatenates to the completion's text.
    ``finish_reason`` (on its last event): stop (EOS or a stop string) | length | cancelled | abort
    (:meth:`Engine.abort`, a server's shutdown deadline) | error;
    ``usage`` and ``info`` come with the last event."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    usage: dict | None = None
    info: dict | None = None
    logprobs: list[TokenLogprob] | None = None  # per token of ``token_ids`` (``SamplingParams.logprobs``)
    prompt_logprobs: list[TokenLogprob] | None = None  # on the last event (``SamplingParams.prompt_logprobs``)
    routed_experts: Tensor | None = None  # on the last event: [tokens, MoE layers, top-k] (routed_experts.py)


@dataclass
class Completion:
    """A finished request, as ``Engine.generate`` returns it."""

    request_id: str
    prompt_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: str
    routing: str | None
    switch_rate: float | None
    error: str | None = None
    trace: Any = None  # its RoutingTrace (EngineConfig.record), as route(record=True) records one prompt
    stop_token: int | None = None  # the EOS token that ended it (not in ``token_ids``)
    logprobs: list[TokenLogprob] | None = None  # per generated token (``SamplingParams.logprobs``)
    prompt_logprobs: list[TokenLogprob] | None = None  # per prompt token after the first (``prompt_logprobs``)
    # SamplingParams.return_routed_experts: [prompt + generated - 1, MoE layers, top-k] (routed_experts.py);
    # a RoE request's K samples: [K, prompt + generated - 1, MoE layers, top-k] (roe_experts.py)
    routed_experts: Tensor | None = None
    # where the engine has a compiled decoding step: why some of this request's steps did not take it
    # (empty: every step compiled); None where it has none (``model_runner``)
    slow_reasons: list[str] | None = None


@dataclass
class Request:
    """One request's state, from the queue to its finish."""

    id: str
    prompt: list[int]
    params: SamplingParams
    routing: Routing | None
    policies: list
    key: int
    on_event: Callable[[Event], None] | None
    stream: TextStream
    generated: list[int] = field(default_factory=list)
    seen: int = 0  # real tokens fed through the model
    submitted: float = field(default_factory=time.perf_counter)
    switches: int = 0
    unsent: list[int] = field(default_factory=list)  # token ids whose text is still held back
    ending: tuple[str, str] | None = None  # (finish reason, last text) until its row is removed
    done: threading.Event = field(default_factory=threading.Event)
    completion: Completion | None = None
    trace: Any = None  # its RoutingTrace; a list of one per copy when it runs as several rows
    copies: int = 1  # batch rows it occupies (``Routing.repeats``: K routed copies, one token stream)
    stop_token: int | None = None  # the EOS token that ended it
    chosen_lp: TokenLogprob | None = None  # the latest chosen token's log-probability, for ``_emit``
    logprobs: list[TokenLogprob] = field(default_factory=list)  # every generated token's
    unsent_lp: list[TokenLogprob] = field(default_factory=list)  # those of ``unsent``
    prompt_lp: list[TokenLogprob] | None = None  # the prompt's, once prefilled (``prompt_logprobs``)
    prompt_seen: Tensor | None = None  # [V] its prompt's tokens, for ``repetition_penalty`` (penalties.py)
    roe_experts: list[Tensor] | None = None  # a RoE request's routed experts so far, [n, K, L, k] each (roe_experts.py)
    slow_reasons: set[str] = field(default_factory=set)  # why its decoding steps left the compiled step


@dataclass
class Chunked:
    """A request whose prompt is being prefilled in chunks: its own cache so far, and its ω and
    switch counts ([1, L, E], [1, L]) to join the batch's with."""

    req: Request
    cache: Any
    prev: Tensor
    switches: Tensor
