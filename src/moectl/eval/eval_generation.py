"""Generation until stop strings under a routing plan: lm-eval's ``generate_until`` over moectl's engine.

Contexts are encoded without special tokens (an empty one is the prefix token), left-truncated to
leave room for ``max_gen_toks`` (within ``max_length`` and the model's context), and decoded by the
one inference engine (``moectl.engine.Engine``: continuous batching, routing per row), each request
with the routing the plan gives it alone (a :class:`RequestBatch` of its own tokens, so a request's
routing never depends on its batch-mates):

- plain or policy routing: the request's rows routed by its policies (request-keyed noise with the
  request's codes, a stream-drawing policy forked with the seed ``reseed`` would give it alone,
  per-sequence state forked; stateless policies shared by every request). Where request-keyed
  noise is all a routing holds per request, its requests share one instance of each policy and
  batch in one group of rows, each row with its own code (``Routing.row_codes``) and position;
  the draws are the same as each request's own copy would make;
- ``repeats = K``: the engine's repeats row kind (``moectl.engine.repeats``): K routed copies per
  request, their distributions averaged in probability space, one shared token stream;
- RoE (``routing.roe``): the engine's RoE path, ``moectl.roe.Ensemble`` — K routing samples per
  token over one clean cache (RoE §2.3), as ``moectl roe generate`` decodes.

Greedy unless ``temperature > 0`` (lm-eval's ``do_sample``); sampling is the engine's
(``engine.sampling.choose_tokens``: Gumbel-max over the top-p nucleus) with a seed per request from
(``seed``, the request's key), so a request samples the same text in any batch (the draws differ
of the loop eval ran before the engine: same law, other seeds). Rows stop at EOS or once their text holds
a stop string; the text is cut before the first stop string, as lm-eval cuts it.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from moectl.adapters.inspect import ModelInfo
from moectl.engine import Engine, EngineConfig, Routing, SamplingParams
from moectl.engine.kv import batchable
from moectl.engine.sampling import MAX_STOP_STRINGS
from moectl.engine.text import cut_at_stop
from moectl.errors import ConfigError
from moectl.eval.forward import BatchRouting, RequestBatch, RoutingPlan, SwitchStats, request_keys
from moectl.eval.request_noise import (
    RequestKeyed,
    RequestRows,
    keyed_alone,
    per_request,
    request_codes,
    request_policies,
    row_codes,
)
from moectl.models.tokens import encode, prefix_token
from moectl.routing.protocols import carries_weights


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


class _Routings:
    """Each request's engine ``Routing`` from the plan's ``BatchRouting`` for that request alone; one
    shared ``Routing`` (one group of rows in the engine) per set of policies that need nothing per request."""

    def __init__(self, model: nn.Module, info: ModelInfo) -> None:
        self.model, self.info = model, info
        self.shared: dict[tuple, tuple[BatchRouting, Routing | None]] = {}
        self.keyed: dict[tuple, tuple[list, list]] = {}  # same -> (the plan's policies, the shared copies)

    def _keyed(self, same: tuple, policies: list) -> list:
        """One list of the keyed policies' copies (no codes of their own: each call's rows bring
        theirs), the others as they are, shared by every request of ``policies`` (one group)."""
        if same not in self.keyed:
            shared = []
            for policy in policies:
                if isinstance(policy, RequestKeyed):
                    policy = copy.copy(policy)
                    policy.request_rows = RequestRows()
                policy.bind(self.info)
                shared.append(policy)
            self.keyed[same] = (policies, shared)  # the plan's policies kept: ``same`` holds their ids
        return self.keyed[same][1]

    def __call__(self, routing: BatchRouting, key: str) -> Routing | None:
        policies = list(routing.policies)
        k = int(routing.repeats)
        same = (tuple(id(p) for p in policies), k, id(routing.roe))
        if same in self.shared:
            return self.shared[same][1]
        for policy in policies:
            if carries_weights(policy):
                policy.attach(self.model)  # a trained controller's weights, as route() merges them
        if routing.roe is None and keyed_alone(policies):
            return Routing.of(self._keyed(same, policies), name="eval", repeats=k, owned=True,
                              row_codes=row_codes([key], k))  # fmt: skip
        if any(per_request(p) for p in policies):
            own = request_policies(policies, key, k)
            for policy in own:
                policy.bind(self.info)
            return Routing.of(own, name="eval", repeats=k, roe=routing.roe, owned=True)
        for policy in policies:
            policy.bind(self.info)
        plain = not policies and k == 1 and routing.roe is None
        shared = None if plain else Routing.of(policies, name="eval", repeats=k, roe=routing.roe, owned=True)
        self.shared[same] = (routing, shared)  # the BatchRouting kept: the ids above stay its objects'
        return shared


_BATCHABLE: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def _params(settings: GenSettings, key: str, seed: int) -> SamplingParams:
    """The engine's sampling of one request: its seed from (``seed``, the request's key)."""
    return SamplingParams(
        max_tokens=settings.max_gen_toks,
        temperature=float(settings.temperature),
        top_p=float(settings.top_p),
        seed=int(request_codes([key], seed)[0]),
        stop=tuple(s for s in settings.until if s)[:MAX_STOP_STRINGS],  # all of them cut the text
    )


def _add_switches(stats: SwitchStats, trace) -> None:
    for one in trace if isinstance(trace, list) else [trace]:
        if one is not None:
            stats.add(one, "generated")


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
    progress: bool = False,
) -> list[str]:
    """The generated text of each context, in order (see the module doc); ``progress``: the engine's
    bar of generated tokens (on an interactive terminal only).

    ``batch_size`` requests decode together (times ``repeats`` rows; one at a time for a model whose
    cache the engine cannot re-batch: recurrent or linear attention, chunked attention, a cache of
    its own). ``stats``: the switch rate of each request's (each copy's) generated tokens, from its
    own routing trace (not under RoE)."""
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    context = int(getattr(model.config, "max_position_embeddings", 0) or 0) or max_length
    room = min(max_length, context) - settings.max_gen_toks
    if room < 1:
        raise ConfigError(
            f"max_gen_toks = {settings.max_gen_toks} leaves no room for the context in max_length = "
            f"{min(max_length, context)}"
        )
    encoded = [(encode(tokenizer, c) or [prefix_token(tokenizer)])[-room:] for c in contexts]
    if not encoded:
        return []
    order = sorted(range(len(encoded)), key=lambda i: (-len(encoded[i]), encoded[i]))
    to_routing = _Routings(model, info)
    routings: list[Routing | None] = []
    params: list[SamplingParams] = []
    for i in order:  # each request's routing as the plan gives it alone: batch-mates change nothing
        ids = torch.tensor([encoded[i]])
        key = request_keys(ids, torch.ones_like(ids))[0]
        routings.append(to_routing(plan(RequestBatch(ids, torch.ones_like(ids), [key], "generate")), key))
        params.append(_params(settings, key, seed))
    rows = max((r.repeats for r in routings if r is not None), default=1)
    if model not in _BATCHABLE:  # one probe forward per model
        _BATCHABLE[model] = batchable(model)
    solo = not _BATCHABLE[model]  # recurrent / chunked attention / a cache of its own: one request at a time
    config = EngineConfig(
        max_batch=batch_size * rows, max_queue=len(order), record=stats is not None, solo=solo
    )
    engine = Engine(model, tokenizer, config, info=info)
    done = engine.generate([encoded[i] for i in order], params, routings, progress=progress)
    texts: list[str] = [""] * len(contexts)
    for i, completion, routing in zip(order, done, routings, strict=True):
        text = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        texts[i] = cut_at_stop(text, [s for s in settings.until if s])[0]
        if stats is not None and (routing is None or routing.roe is None):
            _add_switches(stats, completion.trace)
    return texts
