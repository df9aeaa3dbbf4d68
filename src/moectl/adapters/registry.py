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
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor, nn

from moectl.adapters.rules import RouterRule

if TYPE_CHECKING:
    from moectl.adapters.linear_gate import GateFamily

@dataclass(frozen=True)
class Adapter:
    """How to read and re-route one router class.

    The router's output here is transformers' usual ``(logits, weights, indices)``; a family whose
    router returns another shape subclasses ``Adapter`` and overrides the methods that read and
    rewrite it (``llama4.Llama4Adapter``: dense scores and logits), so no caller switches on a format.
    """

    family: str
    build_rule: Callable[[nn.Module], RouterRule]
    bias: Callable[[nn.Module], Tensor | None] = lambda module: None

    # whether the family's experts hold their weights [in, out] where the experts module does not
    # say (``is_transposed``)
    experts_transposed: ClassVar[bool] = False

    def logits_of(self, output: tuple) -> Tensor:
        """The router logits in the router's output."""
        return output[0]

    def indices_of(self, output: tuple, top_k: int) -> Tensor:
        """The chosen experts in the router's output (as it returned them: [..., k])."""
        return output[2]

    def selection_of(self, output: tuple, top_k: int) -> tuple[Tensor, Tensor]:
        """The router's own selection: (weights [N, E], dense: zero off the chosen; indices [N, k])."""
        logits, weights, idx = output
        weights, idx = weights.reshape(-1, top_k), idx.reshape(-1, top_k)
        dense = torch.zeros(idx.shape[0], logits.shape[-1], dtype=weights.dtype, device=weights.device)
        return dense.scatter_(1, idx, weights), idx

    def repack(self, output: tuple, weights: Tensor, idx: Tensor) -> tuple:
        """The router's output with the selection replaced by ``weights`` / ``idx`` [N, k]."""
        logits, old_w, old_idx = output
        return logits, weights.to(old_w.dtype), idx.to(old_idx.dtype)

    def routed_output(
        self, experts: nn.Module, x: Tensor, weights: Tensor, idx: Tensor, dtype: torch.dtype
    ) -> Tensor:
        """Σ over slots of weights · experts[idx](x) for rows ``x`` [N, H], run in ``dtype``; float32."""
        return experts(x.to(dtype), idx, weights.to(dtype)).float()


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
