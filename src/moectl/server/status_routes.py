"""What a client or a monitor asks about the server: ``GET /v1/models`` (and one model),
``GET /health`` (the only path without the API key) and ``GET /metrics`` (Prometheus)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from moectl.server.metrics import CONTENT_TYPE
from moectl.server.serving_state import Serving, ServingState

router = APIRouter()


@router.get("/v1/models")
async def models(state: Serving) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(state, name) for name in state.served_names]}


@router.get("/v1/models/{name:path}")
async def model(name: str, state: Serving) -> dict[str, Any]:
    state.check_model(name)
    return model_card(state, name)


def model_card(state: ServingState, name: str) -> dict[str, Any]:
    """OpenAI's model object, with what a client of this server also needs: the context length
    (vLLM's ``max_model_len``) and the routings a request may name."""
    return {
        "id": name,
        "object": "model",
        "created": state.started,
        "owned_by": "moectl",
        "max_model_len": state.engine.max_context,
        "routings": state.routing_names(),
        "default_routing": state.default_routing,
    }


@router.get("/health")
async def health(state: Serving) -> dict[str, Any]:
    stats = state.engine.stats()
    return {"status": "ok", "running": stats.get("running", 0), "waiting": stats.get("waiting", 0)}


@router.get("/metrics")
async def prometheus(state: Serving) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
