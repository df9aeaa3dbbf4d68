"""``create_app(engine, model_name)``: the OpenAI-compatible FastAPI app over a :class:`moectl.engine.Engine`.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream``
as server-sent events), ``GET /health``, ``GET /metrics``, and vLLM's tokenizer endpoints
(``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``) that lm-eval's remote tokenizer
uses. A request may name one of the engine's registered routings (``"routing": NAME``; none: the
default routing, if the server has one); it never names a server-side path — anything but a
registered name is a 400 listing them. The app owns the engine's thread: it starts the engine when
the server starts, and when the server stops (uvicorn's SIGTERM handling: no new connections,
in-flight responses finished) it drains the engine before the process exits.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from moectl.lm.lm_head import vocab_size
from moectl.server.api_errors import APIError, install_error_handlers
from moectl.server.auth import APIKeyMiddleware
from moectl.server.engine_events import Generation, collect, merged
from moectl.server.logprob_bodies import chat_logprobs, completion_logprobs
from moectl.server.metrics import CONTENT_TYPE, RequestCounter, ServerMetrics
from moectl.server.prompts import chat_ids, completion_ids
from moectl.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
    message_dicts,
)
from moectl.server.responses import DONE, Shape, sse

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context


class EngineStream(StreamingResponse):
    """A stream that cancels its requests however it ends early: the client disconnected (Starlette
    cancels the body iterator), a send failed, or the iterator never started."""

    def __init__(self, generations: list[Generation], content: AsyncIterator[bytes]) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self.generations = generations

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for generation in self.generations:
                generation.cancel()


def create_app(
    engine: Any, model_name: str | list[str], *, api_key: str | None = None, default_routing: str | None = None
) -> FastAPI:
    """The app serving ``engine``'s model as ``model_name`` (several names: each accepted, each listed
    by /v1/models, the first in responses); ``api_key`` guards every path but /health;
    ``default_routing``: the registered routing of requests that name none (None: the model as trained)."""
    served_names = [model_name] if isinstance(model_name, str) else list(model_name)
    model_name = served_names[0]
    from moectl.engine import SamplingParams

    metrics = ServerMetrics(engine)
    tokenizer = engine.tokenizer
    vocab = vocab_size(engine.model)  # the token ids a prompt may hold
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown, drain=True)

    app = FastAPI(title="moectl", lifespan=lifespan)
    install_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(RequestCounter, metrics=metrics)  # outermost: 401s are counted too
    app.state.metrics = metrics

    def routing_names() -> list[str]:
        return sorted(engine.routings)

    def check_model(name: str) -> None:
        if name not in served_names:
            served = " or ".join(repr(n) for n in served_names)
            raise APIError(
                404, f"model {name!r} is not served here; this server serves {served}",
                param="model", code="model_not_found",
            )

    def check_routing(name: str | None) -> str | None:
        if name is None:
            return default_routing
        if name in engine.routings:
            return name
        names = ", ".join(routing_names()) or "none"
        raise APIError(
            400,
            f"routing {name!r} is not registered on this server; registered: {names} "
            f"(leave routing out for {repr(default_routing) if default_routing else 'the model as trained'})",
            param="routing",
        )

    def max_tokens_for(body: SamplingFields, prompt_len: int, default: int | None, param: str) -> int:
        """The request's max_tokens, checked against the context (a 400 naming what fits); chat's
        default is the rest of the context."""
        if body.max_tokens == 0:  # echo scoring the prompt alone (CompletionRequest.check): one token, left out
            return 1
        context = engine.max_context
        room = None if context is None else context - prompt_len
        if room is not None and room < 1:
            raise APIError(400, f"the prompt is {prompt_len} tokens; the model's context is {context}", param=param)
        if body.max_tokens is None:
            wanted = default or room or COMPLETION_DEFAULT_MAX_TOKENS
            return wanted if room is None else min(wanted, room)
        if room is not None and body.max_tokens > room:
            raise APIError(
                400,
                f"max_tokens={body.max_tokens} with a {prompt_len}-token prompt passes the model's context of "
                f"{context} tokens: at most {room}",
                param="max_tokens",
            )
        return body.max_tokens

    def check_ids(ids: list[int], what: str, param: str) -> None:
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"{what} {bad} is outside the vocabulary [0, {vocab})", param=param)

    def prompt_ids(prompt: str | list[int]) -> list[int]:
        """A completion prompt's ids: text through the tokenizer, token ids checked against the vocabulary."""
        if isinstance(prompt, str):
            return completion_ids(tokenizer, prompt)
        if not prompt:
            raise APIError(400, "a prompt of token ids must hold at least one id", param="prompt")
        check_ids(prompt, "prompt token id", "prompt")
        return [int(t) for t in prompt]

    def start(
        request: Request, body: SamplingFields, ids: list[int], default: int | None, param: str,
        logprobs: int | None = None, prompt_logprobs: int | None = None, choice: int = 0,
    ) -> Generation:  # fmt: skip
        """The request's sampling checked (400 for what the engine refuses) and handed to the engine;
        ``choice`` j of ``n`` draws with ``seed + j`` when the request gives a seed."""
        routing = check_routing(body.routing)
        check_ids([token for token, _ in body.bias_pairs()], "logit_bias token id", "logit_bias")
        try:  # what the engine refuses beyond the request's own checks (e.g. too many stop strings)
            params = SamplingParams(
                max_tokens=max_tokens_for(body, len(ids), default, param),
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
            )
        except ValueError as err:
            raise APIError(400, str(err)) from err
        generation = Generation(engine, metrics, request.state.arrived)
        generation.submit(ids, params, routing)
        return generation

    def start_all(
        request: Request, body: SamplingFields, ids_list: list[list[int]], default: int | None, param: str,
        logprobs: int | None = None, prompt_logprobs: int | None = None,
    ) -> list[Generation]:  # fmt: skip
        """``n`` engine requests per prompt, prompt-major (choice ``i · n + j``); all of them
        cancelled if one is refused."""
        generations: list[Generation] = []
        try:
            for ids in ids_list:
                for j in range(body.n):
                    generations.append(start(request, body, ids, default, param, logprobs, prompt_logprobs, j))
        except BaseException:
            for generation in generations:
                generation.cancel()
            raise
        return generations

    def failed(last: Any) -> None:
        if last.finish_reason == "error":
            raise APIError(500, f"generation failed: {(last.info or {}).get('error', 'engine error')}")

    def usage_of(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}

    async def chat_all(request: Request, body: ChatCompletionRequest, ids: list[int], shape: Shape) -> Response:
        """A chat completion: ``n`` choices of one conversation, streamed or whole."""
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        generations = start_all(request, body, [ids], None, "messages", logprobs)
        if body.stream:
            return EngineStream(generations, stream(generations, shape, body, logprobs is not None))
        done = await collect(generations, request.receive)
        if done is None:
            return Response(status_code=499)  # the client has gone: nobody reads this
        choices, completion_tokens = [], 0
        for index, got in enumerate(done):
            failed(got.last)
            lps = None if logprobs is None else chat_logprobs(tokenizer, got.logprobs or [])
            choices.append(shape.choice(index, got.text, got.last.finish_reason, lps))
            completion_tokens += len(got.token_ids)
        return JSONResponse(shape.choices(choices, usage_of(len(ids), completion_tokens), done[0].last.info))

    async def complete_all(request: Request, body: CompletionRequest, shape: Shape) -> Response:
        """Completions: every prompt ``n`` engine requests, decoded together, streamed (no echo) or
        whole; with ``echo`` the prompt's text (and log-probabilities) first; ``max_tokens: 0`` the
        prompt alone."""
        prompts = body.prompts()
        ids_list = [prompt_ids(p) for p in prompts]
        echo_lp = body.logprobs if body.echo else None
        default = COMPLETION_DEFAULT_MAX_TOKENS
        generations = start_all(request, body, ids_list, default, "prompt", body.logprobs, echo_lp)
        if body.stream:
            return EngineStream(generations, stream(generations, shape, body, body.logprobs is not None))
        done = await collect(generations, request.receive)
        if done is None:
            return Response(status_code=499)
        keep = body.max_tokens != 0
        choices, completion_tokens = [], 0
        for index, got in enumerate(done):
            prompt, ids = prompts[index // body.n], ids_list[index // body.n]
            failed(got.last)
            token_ids = got.token_ids if keep else []
            text = got.text if keep else ""
            if body.echo:
                text = (prompt if isinstance(prompt, str) else tokenizer.decode(ids)) + text
            lps = None
            if body.logprobs is not None:
                tokens, entries = ([*ids], [None, *(got.last.prompt_logprobs or [])]) if body.echo else ([], [])
                lps = completion_logprobs(tokenizer, tokens + token_ids, entries + (got.logprobs or [])[: len(token_ids)])[0]
            finish = got.last.finish_reason if keep else "length"
            choices.append(shape.choice(index, text, finish, lps))
            completion_tokens += len(token_ids)
        usage = usage_of(sum(map(len, ids_list)), completion_tokens)  # a prompt counted once, as OpenAI does
        return JSONResponse(shape.choices(choices, usage, done[0].last.info))

    async def stream(
        generations: list[Generation], shape: Shape, body: SamplingFields, logprobs: bool
    ) -> AsyncIterator[bytes]:
        """Server-sent events of every choice as its tokens come, each chunk naming its choice
        (``index``); the usage (``stream_options.include_usage``) after the last choice finished."""
        if shape.chat:
            for index in range(len(generations)):
                yield sse(shape.chunk(None, role=True, index=index))
        offsets = [0] * len(generations)
        prompt_tokens = completion_tokens = 0
        async for index, event in merged(generations):
            if event.finish_reason == "error":
                error = APIError(500, f"generation failed: {(event.info or {}).get('error', 'engine error')}")
                yield sse(error.body())
                break
            if event.text or event.token_ids:  # a chunk per generated token, its text possibly held back
                lps = None
                if logprobs and shape.chat:
                    lps = chat_logprobs(tokenizer, event.logprobs or [])
                elif logprobs:
                    lps, offsets[index] = completion_logprobs(
                        tokenizer, event.token_ids, event.logprobs or [], offsets[index]
                    )
                yield sse(shape.chunk(event.text, logprobs=lps, index=index))
            if event.finish_reason is not None:
                yield sse(shape.last_chunk(event.finish_reason, event.info, index=index))
                usage = event.usage or {}
                completion_tokens += int(usage.get("completion_tokens", 0))
                if index % body.n == 0:  # a prompt counted once, as OpenAI does
                    prompt_tokens += int(usage.get("prompt_tokens", 0))
        else:
            if body.stream_options and body.stream_options.include_usage:
                yield sse(shape.usage_chunk(usage_of(prompt_tokens, completion_tokens)))
        yield DONE

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(name) for name in served_names]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        check_model(name)
        return model_card(name)

    def model_card(name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": started,
            "owned_by": "moectl",
            "max_model_len": engine.max_context,
            "routings": routing_names(),
            "default_routing": default_routing,
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        body.check()
        check_model(body.model)
        return await complete_all(request, body, Shape(model_name, chat=False))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        body.check()
        check_model(body.model)
        ids = chat_ids(tokenizer, message_dicts(body.messages), body.template_kwargs())
        return await chat_all(request, body, ids, Shape(model_name, chat=True))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's tokenizer endpoints (``/tokenize``, ``/detokenize``, ``/tokenizer_info``): lm-eval's
        ``local-completions`` finds them and tokenizes with the served tokenizer, no local copy needed."""
        body.check()
        if body.model is not None:
            check_model(body.model)
        if body.messages is not None:
            ids = chat_ids(tokenizer, message_dicts(body.messages), body.chat_template_kwargs)
        else:
            ids = [int(i) for i in tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)]
        return {"count": len(ids), "max_model_len": engine.max_context, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        if body.model is not None:
            check_model(body.model)
        check_ids(body.tokens, "token id", "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__, "model_max_length": engine.max_context}
        for name in ("eos_token", "bos_token", "pad_token", "unk_token"):
            value = getattr(tokenizer, name, None)
            info[name] = value if isinstance(value, str) else None
        template = getattr(tokenizer, "chat_template", None)
        info["chat_template"] = template if isinstance(template, str) else None
        return info

    @app.get("/health")
    async def health() -> dict[str, Any]:
        stats = engine.stats()
        return {"status": "ok", "running": stats.get("running", 0), "waiting": stats.get("waiting", 0)}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
