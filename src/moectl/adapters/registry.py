"""Adapters registered by router class: how to read one family's router module.

An adapter knows, for one router class, the selection rule (``RouterRule``) and where the
router's outputs and score-correction bias live. Families register in their own modules
(``softmax_topk``, ``topk_softmax``, ``sigmoid_grouped``, ``llama4``, ``phimoe``); lookup is by
class (walking the MRO, so subclasses inherit), never by name matching.

The exception: remote-code MoE blocks whose router is a bare ``nn.Linear`` (``linear_gate``,
``emo``) register by the *block's class name*, since ``trust_remote_code`` loads a fresh copy of
the class from each checkpoint's own module, which moectl cannot import; ``linear_gate`` checks the
block's structure before adapting it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from torch import Tensor, nn

from moectl.adapters.rules import RouterRule

if TYPE_CHECKING:
    from moectl.adapters.linear_gate import GateFamily

OutputFormat = Literal["triple", "llama4"]


@dataclass(frozen=True)
class Adapter:
    """How to read and re-route one router class."""

    family: str
    build_rule: Callable[[nn.Module], RouterRule]
    output: OutputFormat = "triple"  # (logits, weights, indices) | llama4's (dense scores, logits)
    bias: Callable[[nn.Module], Tensor | None] = lambda module: None

    def logits_of(self, output: tuple) -> Tensor:
        return output[1] if self.output == "llama4" else output[0]


_REGISTRY: dict[type, Adapter] = {}
_GATES: dict[str, GateFamily] = {}  # remote-code block class name -> family
_SUPPORTED: list[str] = []


def register(module_path: str, class_name: str, adapter: Adapter) -> None:
    """Register ``adapter`` for the router class ``module_path.class_name`` if transformers has it."""
    _SUPPORTED.append(f"{class_name} ({adapter.family})")
    try:
        cls = getattr(importlib.import_module(module_path), class_name)
    except (ImportError, AttributeError):
        return
    _REGISTRY[cls] = adapter


def register_gate(family: GateFamily) -> None:
    """Register a remote-code MoE block whose router is a bare Linear, by the block's class name."""
    _SUPPORTED.append(f"{family.block_class}.{family.gate_attr} ({family.adapter.family}, remote code)")
    _GATES[family.block_class] = family


def gate_families() -> dict[str, GateFamily]:
    """Remote-code block class name -> ``GateFamily``."""
    _load_families()
    return _GATES


def adapter_for(module: nn.Module) -> Adapter | None:
    """The adapter registered for this module's class (or a base class), else None."""
    for cls in type(module).__mro__:
        if cls in _REGISTRY:
            return _REGISTRY[cls]
    return None


def supported_routers() -> list[str]:
    """Human-readable list of the router classes with an adapter."""
    _load_families()
    return list(_SUPPORTED)


def _load_families() -> None:
    from moectl.adapters import emo, llama4, phimoe, sigmoid_grouped, softmax_topk, topk_softmax  # noqa: F401


def registry() -> dict[type, Adapter]:
    _load_families()
    return _REGISTRY
