"""Grouped expert GEMMs that follow autocast (registered with transformers as ``"moectl_grouped"``).

transformers' ``grouped_mm`` experts cast the activations to the weights' dtype, because
``grouped_mm`` is not autocast-aware: under bf16 autocast with float32 master weights the experts
ran in float32 — the largest matmuls of the step at half the speed (profiled on the ``small``
preset). This forward casts the expert weights to the autocast dtype instead (the cast is part of
the graph, so gradients reach the float32 masters, as autocast does for ``nn.Linear``), sorts the
(token, expert) pairs by expert and runs one grouped GEMM per projection. Without autocast it is
the same computation in the weights' dtype. On the CPU the groups are padded to repeat their sizes
(``models.grouped_mm.cpu_pad``: oneDNN compiles a kernel per new size).

Supports experts with concatenated ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]
(Qwen2-MoE, OLMoE, Qwen3-MoE, Mixtral layouts), no biases: moectl's pretraining models.
:func:`prefer_on_cpu` also gives it to such models loaded in bf16/fp16 on the CPU in place of
transformers' ``grouped_mm``, for the padding (the bf16 reference model over 20 batches of varying
length: 3.99 s → 2.12 s, ``benchmarks/grouped_experts_cpu.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moectl.models.grouped_mm import combine, group_by_expert
from moectl.models.grouped_mm import compute_dtype as _compute_dtype
from moectl.models.grouped_mm import cpu_pad as _cpu_pad
from moectl.models.grouped_mm import grouped_mm as _grouped_mm

NAME = "moectl_grouped"


def grouped_experts_forward(
    module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor
) -> Tensor:
    """Σ_k w_k · E_{i_k}(x) for every token, with one grouped GEMM per projection."""
    dtype = _compute_dtype(hidden_states)
    pad = _cpu_pad(hidden_states, dtype, top_k_index, module.num_experts)
    groups = group_by_expert(top_k_index, module.num_experts, pad)
    x = groups.gather(hidden_states.to(dtype))
    gate_up = _grouped_mm(x, module.gate_up_proj.to(dtype).transpose(-2, -1), groups.offsets)
    gate, up = gate_up.chunk(2, dim=-1)
    out = _grouped_mm(module.act_fn(gate) * up, module.down_proj.to(dtype).transpose(-2, -1), groups.offsets)
    return combine(out, top_k_weights, groups, hidden_states.shape[0]).to(hidden_states.dtype)


def fits(experts) -> bool:
    """Whether a transformers experts module has the layout this forward (and the offloaded slot
    forward) computes: gated, concatenated ``gate_up_proj``, no bias, [E, out, in] weights, no
    post-expert norm."""
    flags = (
        getattr(experts, "has_gate", None) is True,
        getattr(experts, "has_bias", None) is False,
        getattr(experts, "is_transposed", None) is False,
        getattr(experts, "is_concatenated", True) is True,
        getattr(experts, "has_post_expert_norm", False) is False,
    )
    return all(flags)


def supported(model) -> bool:
    """Whether ``model`` has fused experts modules and every one :func:`fits`."""
    experts = [
        m
        for m in model.modules()
        if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj") and hasattr(m, "num_experts")
    ]
    return bool(experts) and all(fits(m) for m in experts)


def pays_on_cpu(model) -> bool:
    """Whether ``model`` has this forward's layout and bf16/fp16 weights on the CPU, where its padded
    groups beat transformers' ``grouped_mm``."""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu" or param.dtype not in (torch.bfloat16, torch.float16):
        return False
    return supported(model)


def prefer_on_cpu(model) -> str | None:
    """Give ``model`` this forward where it runs transformers' ``grouped_mm`` experts and
    :func:`pays_on_cpu`; returns the implementation it now runs (None: unchanged)."""
    if getattr(getattr(model, "config", None), "_experts_implementation", None) != "grouped_mm":
        return None
    if not pays_on_cpu(model):
        return None
    model.set_experts_implementation(register())
    return NAME


def register() -> str:
    """Register the forward with transformers' experts interface (idempotent); returns its name."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if NAME not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(NAME, grouped_experts_forward)
    return NAME
