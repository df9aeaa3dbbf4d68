"""Layers the compiled decoding step calls as they are: quantized projections and experts (#39, #40).

A quantized layer (``moectl.quant.QuantizedLinear``, ``QuantizedExperts``) multiplies through
moectl's C loops or PyTorch's weight-only kernels, code the compiler cannot trace. The step still
takes such a model whole: each of these layers is one opaque call in its graph
(``moectl::module_linear``, ``moectl::module_experts``) that runs the layer's own ``forward``, as the
eager engine does, while everything between them (norms, rotary, attention over the cache, the
router's selection, residuals, the LM head's argmax) is the step's generated code. Without it a
one-row int4 step at OLMoE-1B-7B's width spent ≈ 17 of 42.5 ms in Python and small operations
between the layers (docs/benchmarks.md).

The graph holds a layer by a key (an int from :func:`register`; a registry of weak references, so
a model's layers leave it when the model goes), and :class:`ModuleCall` stands in
``moectl.lm.decode_step``'s weights where a tensor would.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn

_MODULES: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()
_KEYS = itertools.count(1)


@dataclass(frozen=True)
class ModuleCall:
    """A layer the step calls as it is: its registry key and its output width (a projection's)."""

    key: int
    out_features: int = 0


def register(module: nn.Module, out_features: int = 0) -> ModuleCall:
    """``module`` in the registry under a fresh key (keys are never reused)."""
    key = next(_KEYS)
    _MODULES[key] = module
    return ModuleCall(key, out_features)


def _module(key: int) -> nn.Module:
    module = _MODULES.get(key)
    if module is None:
        raise RuntimeError(f"the compiled step's layer {key} is gone (its model was freed)")
    return module


@torch.library.custom_op("moectl::module_linear", mutates_args=())
def module_linear(x: Tensor, key: int, out_features: int) -> Tensor:
    """The registered projection's ``forward(x)``: [..., out_features], contiguous (the packed weights'
    padded rows make some outputs strided views; the graph's code indexes what the fake op promised)."""
    return _module(key)(x).contiguous()


@module_linear.register_fake
def _(x: Tensor, key: int, out_features: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.custom_op("moectl::module_experts", mutates_args=())
def module_experts(x: Tensor, idx: Tensor, weights: Tensor, key: int) -> Tensor:
    """The registered experts' ``forward(x [N, H], top_k_index [N, k], top_k_weights [N, k])``: [N, H]."""
    return _module(key)(x, idx, weights).contiguous()


@module_experts.register_fake
def _fake_experts(x: Tensor, idx: Tensor, weights: Tensor, key: int) -> Tensor:
    return torch.empty_like(x)
