"""Where each tensor of a transformers MoE model lives in its family's released checkpoints.

transformers 5 fuses the experts of a layer into ``experts.gate_up_proj`` [E, 2I, H] and
``experts.down_proj`` [E, H, I]; the checkpoints people download keep one tensor per expert and
projection (OLMoE ``mlp.experts.0.gate_proj.weight``, Mixtral
``block_sparse_moe.experts.0.w1.weight``), and transformers' conversion mapping
(``transformers/conversion_mapping.py``: ``MergeModulelist(dim=0)`` then ``Concatenate(dim=1)``,
gate before up) fuses them at load. This module gives, for one model tensor, the released
tensors it is made of and where each sits inside it. gpt-oss is released with fused experts
(``mlp.experts.gate_up_proj``, gate and up interleaved), so its tensors keep the model's names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# (gate, up, down) projection names of one expert in the released checkpoints of each family.
EXPERT_PROJECTIONS: dict[str, tuple[str, str, str]] = {
    "olmoe": ("gate_proj", "up_proj", "down_proj"),
    "flex_olmo": ("gate_proj", "up_proj", "down_proj"),
    "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
    "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
    "deepseek_v2": ("gate_proj", "up_proj", "down_proj"),
    "deepseek_v3": ("gate_proj", "up_proj", "down_proj"),
    "mixtral": ("w1", "w3", "w2"),
    "phimoe": ("w1", "w3", "w2"),
}

# Model name -> released name, applied in order (the inverse of the loader's WeightRenaming).
RENAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "mixtral": ((r"\.mlp\.", ".block_sparse_moe."),),
    "phimoe": ((r"\.mlp\.router\.", ".mlp.gate."), (r"\.mlp\.", ".block_sparse_moe.")),
}


@dataclass(frozen=True)
class Piece:
    """One released-checkpoint tensor: its name, shape and place inside a model tensor."""

    key: str
    shape: tuple[int, ...]
    index: tuple[int | slice, ...] = ()  # () = the whole model tensor


def released_name(model_type: str, name: str) -> str:
    """The released-checkpoint spelling of a (non-expert) model tensor name."""
    for pattern, replacement in RENAMES.get(model_type, ()):
        name = re.sub(pattern, replacement, name)
    return name


def checkpoint_pieces(model_type: str, name: str, shape: tuple[int, ...]) -> list[Piece]:
    """The released tensors that make model tensor ``name`` of ``shape``, in writing order."""
    shape = tuple(int(s) for s in shape)
    projections = EXPERT_PROJECTIONS.get(model_type)
    fused = name.endswith((".experts.gate_up_proj", ".experts.down_proj")) and len(shape) == 3
    if projections is None or not fused:
        return [Piece(released_name(model_type, name), shape)]
    prefix = released_name(model_type, name.rsplit(".", 1)[0])  # "...mlp.experts" (renamed)
    gate, up, down = projections
    num_experts, rows, cols = shape
    if name.endswith(".gate_up_proj"):
        half = rows // 2
        return [
            piece
            for e in range(num_experts)
            for piece in (
                Piece(f"{prefix}.{e}.{gate}.weight", (half, cols), (e, slice(0, half))),
                Piece(f"{prefix}.{e}.{up}.weight", (half, cols), (e, slice(half, rows))),
            )
        ]
    return [Piece(f"{prefix}.{e}.{down}.weight", (rows, cols), (e,)) for e in range(num_experts)]
