"""Opaque operations of the compiled decoding step: ``moectl::routed_experts`` and ``moectl::linear``.

Inside ``torch.compile`` the experts' products are either traced (a gather of the chosen experts'
weights contracted with the rows: :func:`moectl.lm.decode_step._experts`) or, where the experts
are large, this custom operation: the graph calls it once per MoE layer and it runs the experts the
way the eager engine does (``models.grouped_experts``: the (row, expert) pairs sorted by expert, one
product per expert used, moectl's bf16 kernels), reading each chosen expert's weights once and
copying none. Gathering copies the chosen experts' weights: at OLMoE-1B-7B's width (12 MB an
expert) that made the compiled step slower than the eager one (``benchmarks/engine_compiled.py``);
at the reference model's (0.2 MB) it is the faster way.

``moectl::linear`` is ``F.linear`` kept whole: for a few rows inductor rewrites a product as its own
multiply-and-sum loop, which for a large weight (OLMoE's 2048 x 2048 projections, its 50304-row LM
head) is slower than the BLAS product the eager engine calls; weights of ``KERNEL_BYTES`` or more
take this call instead.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor

from moectl.kernels import bf16_rows

# experts (bytes of one expert's weights) and weights this large run through the operations
KERNEL_BYTES = 1 << 20


@torch.library.custom_op("moectl::linear", mutates_args=())
def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear``, opaque to the compiler (see the module doc); moectl's bf16 CPU kernel where it
    applies, as the model's own ``nn.Linear`` layers run (``moectl.kernels.cpu_linear``)."""
    if bf16_rows.applies(x, weight):
        return bf16_rows.linear(x, weight, bias)
    return F.linear(x, weight, bias)


@linear.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def large(weight: Tensor) -> bool:
    """Whether ``weight`` is one of ``KERNEL_BYTES`` or more."""
    return weight.numel() * weight.element_size() >= KERNEL_BYTES


def large_experts(gate_up: Tensor, down: Tensor) -> bool:
    """Whether one expert's weights (of stacked [E, 2I, H] and [E, H, I]) take ``KERNEL_BYTES`` or more."""
    return (gate_up[0].numel() + down[0].numel()) * gate_up.element_size() >= KERNEL_BYTES


@torch.library.custom_op("moectl::routed_experts", mutates_args=())
def routed_experts(x: Tensor, idx: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """Σ_j weights[:, j] · expert_{idx[:, j]}(x) for rows ``x`` [N, H] (SiLU-gated experts)."""
    from moectl.models.grouped_experts import grouped_experts_forward

    experts = SimpleNamespace(
        num_experts=gate_up.shape[0], gate_up_proj=gate_up, down_proj=down, act_fn=F.silu
    )
    return grouped_experts_forward(experts, x, idx, weights)


@routed_experts.register_fake
def _fake_experts(x: Tensor, idx: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    return torch.empty_like(x)
