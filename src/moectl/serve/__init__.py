"""Expert-offloading runtime: serve an MoE with only a budget of experts per layer resident.

``ServeOffloadConfig`` and ``run_serve_offload`` (``moectl serve-offload`` as a function,
``serve/runner.py``) load on first use: the runner sits above the engine.
"""

from typing import Any

from moectl.serve.config import OffloadConfig
from moectl.serve.offload import OffloadedExperts, OffloadRuntime, offload
from moectl.serve.policies import parse_policy
from moectl.serve.prefetch import PrefetchConfig
from moectl.serve.store import DiskStore, ExpertStoreError, HostStore

__all__ = [
    "DiskStore",
    "ExpertStoreError",
    "HostStore",
    "OffloadConfig",
    "OffloadRuntime",
    "OffloadedExperts",
    "PrefetchConfig",
    "ServeOffloadConfig",
    "offload",
    "parse_policy",
    "run_serve_offload",
]

_RUNNER = {"ServeOffloadConfig": "ServeOffloadConfig", "run_serve_offload": "run"}


def __getattr__(name: str) -> Any:
    if name in _RUNNER:
        from moectl.serve import runner

        return getattr(runner, _RUNNER[name])
    raise AttributeError(f"module 'moectl.serve' has no attribute {name!r}")
