"""moectl: control expert routing in Mixture-of-Experts language models.

``import moectl`` loads the routing core only (torch, safetensors). Everything that needs
transformers, peft, lm-eval, optuna, matplotlib or accelerate loads on first use (PEP 562): the
names below in ``_LAZY`` and the subpackages (``moectl.roe``, ``moectl.options``, ...).
``moectl`` becomes an lm-eval model name (``lm_eval --model moectl``) when lm-eval's registry is
imported, before or after moectl (:mod:`moectl.lm_eval`).
"""

from __future__ import annotations

import importlib
from typing import Any

from moectl.adapters import ModelInfo, UnsupportedModelError, inspect, self_test, supported_routers
from moectl.errors import ConfigError, MoectlError, MoectlFileError
from moectl.lm_eval import install as _install_lm_eval_backend
from moectl.metrics.switch_rate import switch_rate
from moectl.quant.checkpoint_format import install as _install_quantized_checkpoints
from moectl.routing import (
    DocumentPool,
    ExpertMask,
    GumbelTopK,
    PolicyConfig,
    Replay,
    RoutingTrace,
    load_policy,
    route,
    save_policy,
)

__version__ = "0.1.0"

_install_lm_eval_backend()  # registers the lm-eval backend now or when lm-eval loads (stdlib only)
_install_quantized_checkpoints()  # load_model reads `moectl checkpoint quantize` folders (issue 40 item 2)

# name -> (module, attribute), imported on first access
_LAZY: dict[str, tuple[str, str]] = {
    "tiny": ("moectl.models.tiny", "tiny"),
    "FAMILIES": ("moectl.models.tiny", "FAMILIES"),
    "load": ("moectl.loaded", "load"),
    "Loaded": ("moectl.loaded", "Loaded"),
    "RoEConfig": ("moectl.ensemble.roe_config", "RoEConfig"),
}
_SUBPACKAGES = (
    "adapters", "data", "eval", "io", "metrics", "models", "offload", "options", "quant", "reporting", "roe",
    "routing", "subsets", "train",
)  # fmt: skip

__all__ = [
    "FAMILIES",
    "ConfigError",
    "DocumentPool",
    "ExpertMask",
    "GumbelTopK",
    "Loaded",
    "ModelInfo",
    "MoectlError",
    "MoectlFileError",
    "PolicyConfig",
    "Replay",
    "RoEConfig",
    "RoutingTrace",
    "UnsupportedModelError",
    "inspect",
    "load",
    "load_policy",
    "route",
    "save_policy",
    "self_test",
    "supported_routers",
    "switch_rate",
    "tiny",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    if name in _SUBPACKAGES:
        return importlib.import_module(f"moectl.{name}")
    raise AttributeError(f"module 'moectl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBPACKAGES))
