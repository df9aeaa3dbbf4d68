"""Output: each generated token handed to its request — text, events — and each finished request's end.

``Output.emit`` appends a token to its request (its text streamed through ``text.TextStream``:
held back while it may be an incomplete character or the start of a stop string), sends the
request's event and says whether the request is done (EOS, a stop string, ``max_tokens``);
``Output.finish`` builds its ``Completion`` (switch rate, routed experts), sends its last event and
adds its switches to its routing's figures (``routing_stats``, by the routing's ``stats_name``).
"""

from __future__ import annotations

from typing import Any

from moectl.adapters.inspect import ModelInfo
from moectl.engine.expert_counts import DEFAULT
from moectl.engine.request import Completion, Event, Request
from moectl.engine.roe_experts import routed as roe_routed
from moectl.engine.routed_experts import routed_experts


class Output:
    """Tokens to requests and requests to their ends (see the module doc)."""

    def __init__(self, info: ModelInfo, eos_ids: set[int], counters: dict[str, Any]) -> None:
        self.info, self.eos_ids, self.counters = info, eos_ids, counters
        self.routing_stats: dict[str, dict[str, float]] = {}  # per routing: requests, switches, decode steps
        self.aborted: set[str] = set()  # cancelled requests that end with "abort" (Engine.abort)
        self.compiled = False  # the engine has a compiled decoding step: completions say why steps left it

    def emit(self, req: Request, token: int) -> bool:
        """Hand one new token to its request; finish it if it is done. Returns whether it finished."""
        self.counters["generated_tokens"] += 1
        eos = token in req.params.stop_token_ids or (token in self.eos_ids and not req.params.ignore_eos)
        if eos:
            piece, stopped = req.stream.finish(), True
            req.stop_token = token
        else:
            req.generated.append(token)
            piece, stopped = req.stream.push([token])
        if eos or stopped:
            reason = "stop"
        elif len(req.generated) >= req.params.max_tokens:
            reason = "length"
            piece += req.stream.finish()
        else:
            reason = None
        if not eos:
            req.unsent.append(token)
            if req.chosen_lp is not None:
                req.logprobs.append(req.chosen_lp)
                req.unsent_lp.append(req.chosen_lp)
        req.chosen_lp = None
        if reason is None:
            if req.on_event is not None:  # every token, its text possibly held back (a client times tokens)
                lps = req.unsent_lp if req.params.logprobs is not None else None
                req.on_event(Event(req.id, req.unsent, piece, logprobs=lps))
                req.unsent, req.unsent_lp = [], []
            return False
        req.ending = (reason, piece)  # finished when its row is removed
        return True

    def finish(self, req: Request, reason: str, *, piece: str = "", error: str | None = None) -> None:
        """End ``req``: its completion, its last event (usage, routing, switch rate), its routing's
        figures; a cancelled request whose id is in :attr:`aborted` ends with ``abort``."""
        if req.id in self.aborted:
            self.aborted.discard(req.id)
            reason = "abort" if reason == "cancelled" else reason
        decode_steps = max(len(req.generated) - 1, 0)
        layers = self.info.num_moe_layers
        roe = req.routing is not None and req.routing.roe is not None  # K routings: no one switch rate
        switch_rate = (
            req.switches / (decode_steps * layers * req.copies) if decode_steps and not roe else None
        )
        name = req.routing.name if req.routing is not None else None
        stats_name = req.routing.stats_name if req.routing is not None else None
        completion = Completion(
            req.id,
            len(req.prompt),
            list(req.generated),
            req.stream.text,
            reason,
            name,
            switch_rate,
            error,
            req.trace,
            req.stop_token,
            list(req.logprobs) if req.params.logprobs is not None else None,
            req.prompt_lp,
            self._routed_experts(req) if req.params.return_routed_experts and error is None else None,
            sorted(req.slow_reasons) if self.compiled else None,
        )
        req.completion = completion
        self.counters["finished"] += 1
        stats = self.routing_stats.setdefault(stats_name or DEFAULT, {"requests": 0, "switches": 0, "steps": 0})
        stats["requests"] += 1
        stats["switches"] += req.switches
        stats["steps"] += 0 if roe else decode_steps * layers * req.copies
        if req.on_event is not None:
            usage = {
                "prompt_tokens": len(req.prompt),
                "completion_tokens": len(req.generated),
                "total_tokens": len(req.prompt) + len(req.generated),
            }
            info = {"routing": name, "switch_rate": switch_rate, "slow_reasons": completion.slow_reasons}
            if error is not None:
                info["error"] = error
            lps = req.unsent_lp if req.params.logprobs is not None else None
            req.on_event(
                Event(req.id, req.unsent, piece, reason, usage, info, lps, req.prompt_lp, completion.routed_experts)
            )
            req.unsent, req.unsent_lp = [], []
        req.done.set()

    @staticmethod
    def _routed_experts(req: Request) -> Any:
        """The experts of every forwarded token: [tokens, L, k], or a RoE request's [K, tokens, L, k]."""
        if req.roe_experts is not None:
            return roe_routed(req.roe_experts)
        return routed_experts(req.trace)
