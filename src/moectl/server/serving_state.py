"""What every endpoint of the HTTP server shares: one :class:`ServingState` per app.

The endpoints live in one module per group (``completion_routes.py``, ``chat_routes.py``,
``tokenizer_routes.py``, ``status_routes.py``); the checks they have in common (the model a
request names, its routing, its max_tokens against the context (``--max-model-len``; the default
of a request that gives none, ``--default-max-tokens``), its token ids against the
vocabulary) and the way a request becomes engine generations are methods here, on the state
``create_app`` builds once and keeps in ``app.state.serving``. A handler receives it with the
:data:`Serving` dependency, so a check has one implementation whichever endpoint calls it, and a
test may build the state around a fake engine without an app.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Request

from moectl.lm.lm_head import vocab_size
from moectl.server.api_errors import APIError
from moectl.server.engine_events import Generation
from moectl.server.inline_routing import InlineRoutings
from moectl.server.metrics import ServerMetrics
from moectl.server.prompts import completion_ids
from moectl.server.protocol import SamplingFields
from moectl.server.serve_config import REST_OF_CONTEXT

# OpenAI's (and vLLM's) default max_tokens for /v1/completions; chat's default is the rest of the
# context. A server's --default-max-tokens replaces both (-1: the rest of the context, for both).
COMPLETION_DEFAULT_MAX_TOKENS = 16


@dataclass
class ServingState:
    """The engine an app serves and what its requests are checked against.

    ``served_names``: the names a request may give as ``model`` (the first is reported in
    responses). ``default_routing``: the registered routing of requests that name none (None: the
    model as trained). ``vocab``: the token ids a prompt may hold (the LM head's rows, which may
    be more than the tokenizer's). ``started``: the Unix time /v1/models reports as ``created``.
    ``default_max_tokens``: the max_tokens of a request that gives none, on both endpoints
    (``--default-max-tokens``; -1: the rest of the context; None: OpenAI's defaults, 16 for a
    completion and the rest of the context for a chat). ``chat_template``: the server's chat
    template (``--chat-template``; None: the tokenizer's own).
    """

    engine: Any
    served_names: list[str]
    default_routing: str | None
    metrics: ServerMetrics
    tokenizer: Any
    vocab: int
    started: int = field(default_factory=lambda: int(time.time()))
    routed_experts: bool = False  # --enable-return-routed-experts: every choice carries its routed_experts
    inline: Any = None  # InlineRoutings: the routings requests write inline (set by ``of``)
    default_max_tokens: int | None = None
    chat_template: str | None = None

    @classmethod
    def of(
        cls, engine: Any, served_names: list[str], default_routing: str | None = None, routed_experts: bool = False,
        default_max_tokens: int | None = None, chat_template: str | None = None,
    ) -> ServingState:  # fmt: skip
        """The state of an app serving ``engine`` under ``served_names`` (its metrics new)."""
        return cls(
            engine=engine,
            served_names=list(served_names),
            default_routing=default_routing,
            metrics=ServerMetrics(engine),
            tokenizer=engine.tokenizer,
            vocab=vocab_size(engine.model),
            routed_experts=routed_experts,
            inline=InlineRoutings(engine),
            default_max_tokens=default_max_tokens,
            chat_template=chat_template,
        )

    @property
    def model_name(self) -> str:
        """The name responses report: the first served name."""
        return self.served_names[0]

    def routing_names(self) -> list[str]:
        """The engine's registered routings, sorted (listed by /v1/models and in a 400)."""
        return sorted(self.engine.routings)

    def check_model(self, name: str) -> None:
        """A 404 naming the served names for a model this server does not serve."""
        if name not in self.served_names:
            served = " or ".join(repr(n) for n in self.served_names)
            raise APIError(
                404,
                f"model {name!r} is not served here; this server serves {served}",
                param="model",
                code="model_not_found",
            )

    def check_routing(self, name: Any) -> Any:
        """The routing a request runs under: the one it names if registered (a 400 listing the
        registered ones if not: a request never names a server-side path), a policy it writes
        inline (``inline_routing``), else the default."""
        if name is None:
            return self.default_routing
        if isinstance(name, (dict, list)):
            return self.inline.routing(name)
        if name in self.engine.routings:
            return name
        names = ", ".join(self.routing_names()) or "none"
        default = repr(self.default_routing) if self.default_routing else "the model as trained"
        raise APIError(
            400,
            f"routing {name!r} is not registered on this server; registered: {names} "
            f"(leave routing out for {default})",
            param="routing",
        )

    def max_tokens_for(self, body: SamplingFields, prompt_len: int, default: int | None, param: str) -> int:
        """The request's max_tokens, checked against the context the server admits (``--max-model-len``:
        the engine's ``max_context``; a 400 in vLLM's words naming the numbers). A request that gives
        none gets the server's ``default_max_tokens``, else the endpoint's ``default`` (None: the rest
        of the context), cut to the room the prompt leaves."""
        context = self.engine.max_context
        room = None if context is None else context - prompt_len
        where = "messages" if param == "messages" else "prompt"
        if room is not None and room < 1:
            raise APIError(
                400,
                f"This model's maximum context length is {context} tokens. However, your request has "
                f"{prompt_len} tokens in the {where}, which leaves no room for the completion. Please reduce "
                f"the length of the {where}.",
                param=param,
            )
        if body.max_tokens == 0:  # echo scoring the prompt alone (CompletionRequest.check)
            return 1  # one token, generated and left out
        if body.max_tokens is None:
            wanted = self.default_max_tokens if self.default_max_tokens is not None else default
            if wanted is None or wanted == REST_OF_CONTEXT:
                wanted = room or COMPLETION_DEFAULT_MAX_TOKENS
            return wanted if room is None else min(wanted, room)
        if room is not None and body.max_tokens > room:
            raise APIError(
                400,
                f"This model's maximum context length is {context} tokens. However, you requested "
                f"{prompt_len + body.max_tokens} tokens ({prompt_len} in the {where}, {body.max_tokens} in "
                f"the completion). Please reduce the length of the {where} or completion: max_tokens at "
                f"most {room} with this {where}.",
                param="max_tokens",
            )
        return body.max_tokens

    def check_ids(self, ids: list[int], what: str, param: str) -> None:
        """A 400 for the first id outside the vocabulary (the model would index past its head)."""
        bad = next((t for t in ids if not 0 <= t < self.vocab), None)
        if bad is not None:
            raise APIError(400, f"{what} {bad} is outside the vocabulary [0, {self.vocab})", param=param)

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A completion prompt's ids: text through the tokenizer, token ids checked against the vocabulary."""
        if isinstance(prompt, str):
            return completion_ids(self.tokenizer, prompt)
        if not prompt:
            raise APIError(400, "a prompt of token ids must hold at least one id", param="prompt")
        self.check_ids(prompt, "prompt token id", "prompt")
        return [int(t) for t in prompt]

    def start(
        self, request: Request, body: SamplingFields, ids: list[int], default: int | None, param: str,
        logprobs: int | None = None, prompt_logprobs: int | None = None, choice: int = 0,
    ) -> Generation:  # fmt: skip
        """The request's sampling checked (400 for what the engine refuses) and handed to the engine;
        ``choice`` j of ``n`` draws with ``seed + j`` when the request gives a seed."""
        from moectl.engine import SamplingParams

        routing = self.check_routing(body.routing)
        self.check_ids([token for token, _ in body.bias_pairs()], "logit_bias token id", "logit_bias")
        try:  # what the engine refuses beyond the request's own checks (e.g. too many stop strings)
            params = SamplingParams(
                max_tokens=self.max_tokens_for(body, len(ids), default, param),
                temperature=body.temperature,
                top_p=body.top_p,
                seed=None if body.seed is None else body.seed + choice,
                stop=body.stop_list(),
                ignore_eos=body.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                top_k=max(0, body.top_k),
                min_p=body.min_p,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty,
                logit_bias=body.bias_pairs(),
                stop_token_ids=tuple(body.stop_token_ids or ()),
                min_tokens=body.min_tokens,
                return_routed_experts=body.return_routed_experts or self.routed_experts,
            )
        except ValueError as err:
            raise APIError(400, str(err)) from err
        generation = Generation(self.engine, self.metrics, request.state.arrived)
        generation.submit(ids, params, routing)
        return generation

    def start_all(
        self, request: Request, body: SamplingFields, ids_list: list[list[int]], default: int | None, param: str,
        logprobs: int | None = None, prompt_logprobs: int | None = None,
    ) -> list[Generation]:  # fmt: skip
        """``n`` engine requests per prompt, prompt-major (choice ``i · n + j``); all of them
        cancelled if one is refused."""
        generations: list[Generation] = []
        try:
            for ids in ids_list:
                for j in range(body.n):
                    generations.append(
                        self.start(request, body, ids, default, param, logprobs, prompt_logprobs, j)
                    )
        except BaseException:
            for generation in generations:
                generation.cancel()
            raise
        return generations


def failed(last: Any) -> None:
    """A 500 for a whole (non-streamed) response whose generation ended in an engine error."""
    if last.finish_reason == "error":
        raise APIError(500, f"generation failed: {(last.info or {}).get('error', 'engine error')}")


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's ``usage`` object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}


def serving_state(request: Request) -> ServingState:
    """The dependency every endpoint takes: the state ``create_app`` put in ``app.state.serving``."""
    return request.app.state.serving


Serving = Annotated[ServingState, Depends(serving_state)]
"""A handler's parameter ``state: Serving`` receives the app's :class:`ServingState`."""


def limit_context(engine: Any, max_model_len: int | None) -> None:
    """Admit at most ``max_model_len`` tokens per request (prompt + max_tokens; vLLM's
    ``--max-model-len``): the engine's ``max_context``, which it checks every request against and
    which /v1/models and /tokenize report. None keeps the model's own (``max_position_embeddings``).
    :class:`~moectl.errors.ConfigError` for a length below 1 or past what the model supports."""
    from moectl.errors import ConfigError

    if max_model_len is None:
        return
    supported = model_context(engine)
    if max_model_len < 1:
        raise ConfigError(f"--max-model-len must be a number of tokens >= 1, got {max_model_len}")
    if supported is not None and max_model_len > supported:
        raise ConfigError(
            f"--max-model-len {max_model_len} is more than the model supports: its max_position_embeddings "
            f"is {supported} tokens (give at most {supported}, or leave the flag out)"
        )
    engine.max_context = int(max_model_len)


def model_context(engine: Any) -> int | None:
    """The context the model supports: its config's ``max_position_embeddings`` (as the engine reads
    it), whatever ``--max-model-len`` has set since; None where the config names none."""
    config = getattr(getattr(engine, "model", None), "config", None)
    if config is None:
        return engine.max_context
    return int(getattr(config, "max_position_embeddings", 0) or 0) or None
