"""Expert use per routing on demand, under SGLang's endpoint names (``engine/expert_counts.py``).

``POST /start_expert_distribution_record`` opens a window (dropping the last one's counts),
``POST /stop_expert_distribution_record`` closes it, ``POST /dump_expert_distribution_record``
returns its counts as JSON — per routing (``default``: requests that name none) the tokens routed to
each expert of each MoE layer, ``counts[layer][expert]`` — while recording or after. GET works too.
While a window holds counts, ``/metrics`` exports them as ``moectl_expert_tokens``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from moectl.server.serving_state import Serving

router = APIRouter()
METHODS = ["GET", "POST"]


@router.api_route("/start_expert_distribution_record", methods=METHODS)
async def start_record(state: Serving) -> dict[str, Any]:
    state.engine.expert_counts.start()
    return {"recording": True}


@router.api_route("/stop_expert_distribution_record", methods=METHODS)
async def stop_record(state: Serving) -> dict[str, Any]:
    state.engine.expert_counts.stop()
    return {"recording": False}


@router.api_route("/dump_expert_distribution_record", methods=METHODS)
async def dump_record(state: Serving) -> dict[str, Any]:
    return state.engine.expert_counts.dump()
