"""``--model_args`` of ``lm_eval --model moectl``: the keys, their types, and a clear error for the rest.

lm-eval splits a model_args string at every comma, so ``roe=K=16,tau=0.3`` arrives as
``roe=K=16`` and ``tau=0.3``. RoE's inline keys (``K``, ``tau``, ``aggregation``, ``cache``) that
follow ``roe=`` are therefore joined back to it; ``roe=K=16;tau=0.3`` (``;`` for ``,``) works too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from moectl.errors import ConfigError

MODEL_ARGS: dict[str, str] = {
    "pretrained": "tiny:FAMILY, shape:NAME, a checkpoint folder or a hub id (moectl.load)",
    "policy": "a policy file or folder, or a short form such as option:8 (moectl.load_policy)",
    "roe": "a RoE tau profile file, or K=16,tau=0.3 (Roster of Experts)",
    "controller": "a controller folder (moectl options train)",
    "device": "cpu, cuda, cuda:1, mps (default: cuda when available, else cpu)",
    "dtype": "auto, float32, bfloat16, float16 or float64",
    "batch_size": "requests per forward pass (an integer)",
    "max_length": "tokens per sequence (default: the model's max_position_embeddings)",
    "seed": "seed of routing noise, controllers and sampling (default 1234)",
    "max_batch_size": "accepted for lm-eval's sake and ignored",
}
ROE_KEYS = ("K", "tau", "aggregation", "cache")
DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")


def _allowed() -> str:
    return "; ".join(f"{k} ({v})" for k, v in MODEL_ARGS.items())


def from_items(items: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """The model_args of ``(key, value)`` pairs in the order given, RoE keys joined to ``roe``."""
    args: dict[str, Any] = {}
    for key, value in items:
        key = str(key).strip()
        if key in ROE_KEYS and "roe" in args:
            args["roe"] = f"{args['roe']},{key}={value}"
            continue
        if key not in MODEL_ARGS:
            hint = " (RoE keys belong after roe=, e.g. roe=K=16,tau=0.3)" if key in ROE_KEYS else ""
            raise ConfigError(
                f"lm_eval --model moectl: unknown model_args key {key!r}{hint}; allowed: {_allowed()}"
            )
        args[key] = value
    if isinstance(args.get("roe"), str):
        args["roe"] = args["roe"].replace(";", ",")
    return args


def parse(arg_string: str | None) -> dict[str, Any]:
    """model_args of a ``key=value,key=value`` string (values stay strings; see :func:`normalise`)."""
    items = []
    for part in (arg_string or "").split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        if not sep:
            raise ConfigError(f"lm_eval --model moectl: model_args needs key=value pairs, got {part!r}")
        items.append((key, value.strip()))
    return from_items(items)


def _integer(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        extra = " ('auto' is not supported: give a number)" if key == "batch_size" else ""
        raise ConfigError(
            f"lm_eval --model moectl: {key} must be an integer >= {minimum}, got {value!r}{extra}"
        )
    return value


def normalise(args: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Checked, typed model_args; ``defaults`` (lm-eval's ``batch_size``, ``device``, ...) fill what
    model_args leave out. ``ValueError`` names the key and what is allowed."""
    out = dict(from_items((k, v) for k, v in (defaults or {}).items() if v is not None and k not in args))
    out.update(from_items(args.items()))
    if not isinstance(out.get("pretrained"), str) or not out["pretrained"]:
        raise ConfigError(f"lm_eval --model moectl: model_args needs pretrained=MODEL; allowed: {_allowed()}")
    for key, minimum in (("batch_size", 1), ("max_length", 2), ("seed", 0)):
        if out.get(key) is not None:
            out[key] = _integer(key, out[key], minimum)
    out.pop("max_batch_size", None)
    dtype = out.get("dtype", "auto")
    if dtype not in DTYPES:
        raise ConfigError(f"lm_eval --model moectl: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    for key in ("policy", "roe", "controller", "device"):
        if key in out and out[key] is not None:
            out[key] = str(out[key])
    return out
