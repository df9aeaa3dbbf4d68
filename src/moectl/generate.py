"""Generate from prompts through the engine, with a progress bar: the library's batch entry point.

``generate`` / ``generate_tokens`` / ``generate_traced`` decode a list of prompts with the engine
(``moectl.engine``: continuous batching, ``batch_size`` rows at a time), optionally under routing
``policies`` applied to every prompt (each prompt gets its own fork of a policy with sequence
state) and recording each prompt's routing. Prompt ``i`` samples with seed ``seed + i``.

Inside a caller's own ``moectl.route(...)`` session (``with route(model, policy, record=True):
generate(...)``) prompts are decoded one at a time, so that session sees each prompt as a sequence
of its own, as it would around ``model.generate``; pass ``policies=`` / use ``generate_traced``
to have them batched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moectl.data.jsonl import read_jsonl_rows
from moectl.errors import ConfigError, FileFormatError, MoectlFileError

DEFAULT_PROMPTS = [
    {"prompt": "The quick brown fox jumps over the lazy dog because", "category": "chat"},
    {"prompt": "def fibonacci(n):\n    ", "category": "code"},
    {"prompt": "Let x be a real number such that 3x + 7 = 22. Then x =", "category": "math"},
    {"prompt": "Photosynthesis converts light energy into", "category": "stem"},
    {"prompt": "Der schnelle braune Fuchs springt über", "category": "multi-de"},
    {"prompt": "El rápido zorro marrón salta sobre", "category": "multi-es"},
]


@dataclass
class Prompt:
    text: str
    category: str = "all"


def load_prompts(path: str | Path | None) -> list[Prompt]:
    """Read JSONL prompts (``prompt`` or ``text`` field, optional ``category``); None: built-in set."""
    if path is None:
        return [Prompt(p["prompt"], p["category"]) for p in DEFAULT_PROMPTS]
    path = Path(path)
    if not path.exists():
        raise MoectlFileError(f"prompts file {path} does not exist")
    prompts = [
        Prompt(row.get("prompt", row.get("text")), str(row.get("category", "all")))
        for row in read_jsonl_rows(path, ("prompt", "text"))
    ]
    if not prompts:
        raise FileFormatError(f"{path} holds no prompts")
    return prompts


def generate_completions(
    model,
    tokenizer,
    prompts: Sequence[Prompt | str],
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    batch_size: int = 8,
    seed: int = 0,
    ignore_eos: bool = True,
    progress: bool = True,
    policies: Any = None,
    record: bool = False,
    top_p: float = 1.0,
) -> list:
    """The engine's ``Completion`` of each prompt (text, token ids, switch rate, trace if ``record``).

    ``ignore_eos`` forces every sequence to its full length, as TE-MoE §3.1 measures switch rates
    on 256 generated tokens per prompt. ``policies``: anything ``moectl.route`` takes, applied to
    every prompt."""
    from moectl.engine import Engine, EngineConfig, SamplingParams
    from moectl.routing.session import sessions_on

    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    params = SamplingParams(max_new_tokens, temperature, top_p, seed=seed, ignore_eos=ignore_eos)
    inside_session = sessions_on(model) > 0
    config = EngineConfig(max_batch=1 if inside_session else batch_size, max_queue=batch_size, record=record)
    routings = None if policies is None else {"policies": policies}
    engine = Engine(model, tokenizer, config, routings=routings)
    texts = [p.text if isinstance(p, Prompt) else str(p) for p in prompts]
    routing = None if policies is None else "policies"
    return engine.generate(texts, params, routing, progress=progress, seed_per_prompt=True)


def generate(model, tokenizer, prompts: Sequence[Prompt | str], *args: Any, **kwargs: Any) -> list[str]:
    """Generate ``max_new_tokens`` per prompt; returns the new text (see ``generate_completions``)."""
    return [c.text for c in generate_completions(model, tokenizer, prompts, *args, **kwargs)]


def generate_tokens(
    model, tokenizer, prompts: Sequence[Prompt | str], *args: Any, **kwargs: Any
) -> list[list[int]]:
    """As :func:`generate`, but the new token ids of each prompt (what the routing trace saw)."""
    return [c.token_ids for c in generate_completions(model, tokenizer, prompts, *args, **kwargs)]


def generate_traced(model, tokenizer, prompts: Sequence[Prompt | str], *args: Any, **kwargs: Any) -> tuple:
    """(texts, trace): :func:`generate` recording each prompt's routing, joined as one batch trace
    (``RoutingTrace.join``; row i is prompt i)."""
    from moectl.routing.trace import RoutingTrace

    done = generate_completions(model, tokenizer, prompts, *args, record=True, **kwargs)
    return [c.text for c in done], RoutingTrace.join([c.trace for c in done])
