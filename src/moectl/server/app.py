"""``create_app(engine, model_name)``: the OpenAI-compatible FastAPI app over a :class:`moectl.engine.Engine`.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream``
as server-sent events), ``GET /health``, ``GET /metrics``, and vLLM's tokenizer endpoints
(``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``) that lm-eval's remote tokenizer
uses; an unknown path or method is a 404 (405) listing every route the app answers, FastAPI's
``/docs`` and ``/openapi.json`` included. A request may name one of the engine's registered routings (``"routing": NAME``; none: the
default routing, if the server has one); it never names a server-side path — anything but a
registered name is a 400 listing them. The app owns the engine's thread: it starts the engine when
the server starts, and when the server stops (uvicorn's SIGTERM handling: no new connections,
in-flight responses finished) it drains the engine before the process exits.

This module only assembles the app: each endpoint group is an ``APIRouter`` of its own module
(``completion_routes.py``, ``chat_routes.py``, ``tokenizer_routes.py``, ``status_routes.py``), and
what they share — the engine, the tokenizer, the served names, the default routing, the metrics and
the checks on them — is one :class:`~moectl.server.serving_state.ServingState` in
``app.state.serving``, which each handler receives as a dependency.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from moectl.server import chat_routes, completion_routes, expert_routes, status_routes, tokenizer_routes
from moectl.server.api_errors import endpoints, install_error_handlers
from moectl.server.auth import APIKeyMiddleware
from moectl.server.chat_template import check_renders
from moectl.server.metrics import RequestCounter
from moectl.server.serving_state import ServingState, limit_context

ROUTERS = (
    status_routes.router,
    completion_routes.router,
    chat_routes.router,
    tokenizer_routes.router,
    expert_routes.router,
)


def create_app(
    engine: Any,
    model_name: str | list[str],
    *,
    api_key: str | None = None,
    default_routing: str | None = None,
    return_routed_experts: bool = False,
    max_model_len: int | None = None,
    default_max_tokens: int | None = None,
    chat_template: str | None = None,
) -> FastAPI:
    """The app serving ``engine``'s model as ``model_name`` (several names: each accepted, each listed
    by /v1/models, the first in responses); ``api_key`` guards every path but /health;
    ``default_routing``: the registered routing of requests that name none (None: the model as trained);
    ``return_routed_experts``: every choice carries its ``routed_experts`` (else those that ask);
    ``max_model_len``: the tokens a request may hold, prompt + max_tokens (None: the model's
    ``max_position_embeddings``; more is a ``ConfigError``); ``default_max_tokens``: the max_tokens
    of a request that gives none, on both endpoints (-1: the rest of the context; None: 16 for a
    completion, the rest of the context for a chat, as OpenAI and vLLM); ``chat_template``: a Jinja
    chat template's text used instead of the tokenizer's (``ConfigError`` if it cannot render a
    one-message conversation)."""
    served_names = [model_name] if isinstance(model_name, str) else list(model_name)
    limit_context(engine, max_model_len)
    if chat_template is not None:
        check_renders(engine.tokenizer, chat_template)
    state = ServingState.of(
        engine, served_names, default_routing, return_routed_experts, default_max_tokens, chat_template
    )

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
    app.add_middleware(RequestCounter, metrics=state.metrics)  # outermost: 401s are counted too
    app.state.serving = state
    app.state.metrics = state.metrics
    for router in ROUTERS:
        app.include_router(router)
    # what a 404 lists: every route the app answers, ours (FastAPI keeps an included router as one
    # entry of app.routes, so they are read from the routers) and the app's own (/docs, /openapi.json)
    app.state.endpoints = endpoints([*ROUTERS, app.router])
    return app
