"""The experts forward over resident slots: expert ids mapped to slots, one grouped GEMM per projection.

Offloading used to run transformers' eager experts forward against views of the slots: a Python
loop over the chosen experts with a mask, a gather, two products and a scatter each — about 7% of
a decode step more than the model's own grouped forward (``benchmarks/decode_profile.py``). Here
the chosen experts are made resident first (``ResidentSet.access`` in ascending expert order, as
the eager loop visits them, so hits, misses, loads and LRU order are unchanged), the [T, k] expert
ids are mapped to slot ids with one gather, and the slots are multiplied as the groups of one
``grouped_mm`` per projection (``moectl.models.grouped_mm``).

It needs every chosen expert resident at once, so a forward that touches more distinct experts
than the budget holds (a long prefill under a small budget) runs the eager loop instead, which
computes each expert while it is resident. Supported layouts: transformers' concatenated
``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I], no biases, not transposed, no post-expert
norm (Qwen2/3-MoE, OLMoE, Mixtral, DeepSeek, Phi-MoE); the gate is the module's own
``_apply_gate``. Other layouts (gpt-oss: biases, transposed) keep the eager loop.

int8 slots (``offload/int8.py``) hold each weight as int8 with per-row scales; the groups are then
multiplied one resident slot at a time by the int8 weight-only kernel (a decode step touches
top-k slots per layer: k products per projection, no per-token loop; one host sync per layer for
the group sizes).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moectl.models.grouped_experts import fits
from moectl.models.grouped_mm import combine, cpu_pad, group_by_expert, grouped_mm
from moectl.offload.int8 import SCALE, int8_linear

NAMES = frozenset({"gate_up_proj", "down_proj"})


def supports(experts: nn.Module, offloaded: set[str] | frozenset[str]) -> bool:
    """Whether ``experts`` (transformers' experts module) has the layout this forward computes."""
    return fits(experts) and set(offloaded) == NAMES and callable(getattr(experts, "_apply_gate", None))


def slot_experts_forward(
    experts: nn.Module, slots: dict[str, Tensor], hidden: Tensor, slot_index: Tensor, weights: Tensor
) -> Tensor:
    """Σ_k w_k · E_{slot_k}(x) per token: hidden [T, H], slot_index and weights [T, k]."""
    num_slots = slots["gate_up_proj"].shape[0]
    dtype = slots["gate_up_proj"].dtype
    if dtype == torch.int8:
        groups = group_by_expert(slot_index, num_slots)
        out = _int8_groups(experts, slots, hidden[groups.rows], groups.counts.tolist())
    else:  # a long prompt's groups are padded on the CPU (oneDNN compiles a kernel per group size)
        pad = cpu_pad(hidden, dtype, slot_index, num_slots)
        groups = group_by_expert(slot_index, num_slots, pad)
        x = groups.gather(hidden)
        gate_up = grouped_mm(x, slots["gate_up_proj"].transpose(-2, -1), groups.offsets)
        out = grouped_mm(experts._apply_gate(gate_up), slots["down_proj"].transpose(-2, -1), groups.offsets)
    return combine(out, weights, groups, hidden.shape[0]).to(hidden.dtype)


def _int8_groups(experts: nn.Module, slots: dict[str, Tensor], x: Tensor, counts: list[int]) -> Tensor:
    """The experts of int8 slots over ``x`` (rows sorted by slot, ``counts[s]`` rows for slot s)."""
    outs, start = [], 0
    for slot, count in enumerate(counts):
        if count == 0:
            continue
        rows = x[start : start + count]
        start += count
        gate_up = int8_linear(rows, slots["gate_up_proj"][slot], slots["gate_up_proj" + SCALE][slot])
        h = experts._apply_gate(gate_up)
        outs.append(int8_linear(h, slots["down_proj"][slot], slots["down_proj" + SCALE][slot]))
    return torch.cat(outs)
