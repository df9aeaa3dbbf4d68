"""The [E, ...] tensors of an experts module that offloading moves to the store and back.

A transformers experts module holds them as parameters (``gate_up_proj``, ``down_proj``, gpt-oss's
biases). A module that is already quantized (``moectl.quant.QuantizedExperts``, issue 40 item 2)
holds them as buffers of submodules (int4: ``gate_up.packed``, ``gate_up.scale_zero``, ...; int8:
``gate_up.codes``, ``gate_up.scale``) and says so through an ``expert_tensors()`` method, so the
offloading runtime moves the quantized bytes — a miss reads int4 — without importing ``moectl.quant``
(that package imports this one). A tensor is named by its dotted path inside the experts module.

:func:`take` removes one and puts a stand-in (the runtime's slot view) in its place; :func:`put_back`
registers the full tensor again as what it was (parameter, with its ``requires_grad``, or buffer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class TensorMeta:
    """What a removed tensor was: parameter or buffer, its shape and dtype."""

    parameter: bool
    requires_grad: bool
    shape: tuple[int, ...]
    dtype: torch.dtype


def per_expert(experts: nn.Module, num_experts: int) -> dict[str, Tensor]:
    """The module's tensors with one slice per expert (dotted name -> [E, ...] tensor, the registered
    object itself: a parameter's identity is what tells it from the model's other tensors)."""
    declared = getattr(experts, "expert_tensors", None)
    if callable(declared):
        return dict(declared())
    return {
        n: p for n, p in experts.named_parameters(recurse=False) if p.dim() >= 2 and p.shape[0] == num_experts
    }


def _owner(experts: nn.Module, name: str) -> tuple[nn.Module, str]:
    prefix, _, leaf = name.rpartition(".")
    return (experts.get_submodule(prefix) if prefix else experts), leaf


def meta_of(experts: nn.Module, name: str) -> TensorMeta:
    owner, leaf = _owner(experts, name)
    parameter = leaf in owner._parameters
    t = owner._parameters[leaf] if parameter else owner._buffers[leaf]
    return TensorMeta(parameter, bool(parameter and t.requires_grad), tuple(t.shape), t.dtype)


def take(experts: nn.Module, name: str, stand_in: object) -> None:
    """Remove tensor ``name`` from ``experts`` (freeing it) and put ``stand_in`` in its place."""
    owner, leaf = _owner(experts, name)
    owner._parameters.pop(leaf, None)
    owner._buffers.pop(leaf, None)
    object.__setattr__(owner, leaf, stand_in)


def present(experts: nn.Module, name: str) -> bool:
    """Whether tensor ``name`` is still registered (never taken: an install that failed part way)."""
    owner, leaf = _owner(experts, name)
    return leaf in owner._parameters or leaf in owner._buffers


def put_back(experts: nn.Module, name: str, meta: TensorMeta, full: Tensor) -> None:
    """Register ``full`` as tensor ``name`` again, as the parameter or buffer it was."""
    owner, leaf = _owner(experts, name)
    owner.__dict__.pop(leaf, None)
    if meta.parameter:
        owner.register_parameter(leaf, nn.Parameter(full, requires_grad=meta.requires_grad))
    else:
        owner.register_buffer(leaf, full)
