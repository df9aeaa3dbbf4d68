"""The inference engine: continuous batching with routing per row, over an optional offload runtime.

``Engine(model, tokenizer, EngineConfig(max_batch=8), routings={"math": "math.subset.json"})``;
``engine.generate(prompts, SamplingParams(max_tokens=32))`` or, for a server, ``engine.start()`` and
``engine.submit(prompt_ids, params, routing="math", on_event=callback)``. See ``engine.py``.
"""

from moectl.engine.engine import (
    Completion,
    Engine,
    EngineClosed,
    EngineConfig,
    Event,
    QueueFull,
    RequestFailed,
)
from moectl.engine.kv import UnbatchableCacheError
from moectl.engine.routings import Routing
from moectl.engine.sampling import SamplingParams

__all__ = [
    "Completion",
    "Engine",
    "EngineClosed",
    "EngineConfig",
    "Event",
    "QueueFull",
    "RequestFailed",
    "Routing",
    "SamplingParams",
    "UnbatchableCacheError",
]
