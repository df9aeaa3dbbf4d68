"""Serving above the engine: ``moectl serve`` (the OpenAI-compatible HTTP server: ``app.py`` and its
neighbours) and ``moectl serve-offload`` (``offload_batch.py``: a batch of prompts with experts
offloaded, and its report).

Importing this package loads neither FastAPI nor a model: ``ServeOffloadConfig``,
``run_serve_offload`` and ``serve_offload`` load on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ServeOffloadConfig", "run_serve_offload", "serve_offload"]

_LAZY = {"ServeOffloadConfig": "ServeOffloadConfig", "run_serve_offload": "run", "serve_offload": "serve_offload"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from moectl.server import offload_batch

        return getattr(offload_batch, _LAZY[name])
    raise AttributeError(f"module 'moectl.server' has no attribute {name!r}")
