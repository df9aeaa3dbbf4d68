"""Serving above the engine: ``moectl serve`` (the OpenAI-compatible HTTP server: ``app.py``
assembles it from one router module per endpoint group, ``serve_config.py`` and ``serve_run.py``
are the verb as a config and a function) and ``moectl serve-offload`` (``offload_batch.py``: a
batch of prompts with experts offloaded, and its report).

Importing this package loads neither FastAPI nor a model: ``ServeConfig``, ``run_serve``,
``ServeOffloadConfig``, ``run_serve_offload`` and ``serve_offload`` load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ServeConfig", "ServeOffloadConfig", "run_serve", "run_serve_offload", "serve_offload"]

_LAZY = {  # name -> (module, attribute)
    "ServeConfig": ("serve_config", "ServeConfig"),
    "run_serve": ("serve_run", "run_serve"),
    "ServeOffloadConfig": ("offload_batch", "ServeOffloadConfig"),
    "run_serve_offload": ("offload_batch", "run"),
    "serve_offload": ("offload_batch", "serve_offload"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attribute = _LAZY[name]
        return getattr(importlib.import_module(f"moectl.server.{module}"), attribute)
    raise AttributeError(f"module 'moectl.server' has no attribute {name!r}")
