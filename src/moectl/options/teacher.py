"""The teacher without a second copy (TE-MoE §4.3): the same network with adapters disabled.

The intra-option policy is trained through LoRA adapters on attention (PEFT) and expert weights
(``expert_lora.py``: the low-rank product on the selected experts' activations; PEFT's
``target_parameters`` where those experts are not supported), and the routers train in place.
:func:`teacher_mode` disables the adapters (``PeftModel.disable_adapter`` and
``expert_lora_disabled``) and swaps the routers' original weights back in for the duration of the
teacher's forward; the snapshot is only the router weights (N × d per MoE layer).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo
from moectl.errors import UnsupportedModelError
from moectl.options.expert_lora import (
    add_expert_lora,
    expert_lora_disabled,
    experts_modules,
    unsupported_reason,
)

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj", "gate_proj", "up_proj", "w1", "w2", "w3")


def expert_parameter_names(model: nn.Module, info: ModelInfo) -> list[str]:
    """Suffixes (``mlp.experts.gate_up_proj``) of the routed experts' stacked 3-D weights."""
    names: set[str] = set()
    for name, param in model.named_parameters():
        parts = name.split(".")
        if param.dim() == 3 and "experts" in parts and parts[-1] in EXPERT_PARAMETERS:
            names.add(".".join(parts[parts.index("experts") - 1 :]))
    return sorted(names)


def add_lora(
    model: nn.Module,
    info: ModelInfo,
    r: int = 16,
    alpha: int = 16,
    train_router: bool = True,
    experts: bool = True,
    cheap_experts: bool = True,
):
    """Wrap ``model`` with LoRA (r = α = 16, §5) on attention projections and expert weights.

    Returns (peft_model, router_snapshot). Router weights get ``requires_grad`` when ``train_router``.
    ``cheap_experts``: expert LoRA on the selected experts' activations (:mod:`expert_lora`) where
    every MoE layer's experts support it; otherwise (or False) PEFT's ``target_parameters``.
    """
    from peft import LoraConfig

    from moectl.models.peft_quiet import get_peft_model

    attention = sorted(
        {
            n.rsplit(".", 1)[-1]
            for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and n.endswith(ATTENTION_MODULES)
        }
    )
    experts = expert_parameter_names(model, info) if experts else []
    if not attention and not experts:
        raise UnsupportedModelError("found no attention projections or stacked expert weights to put LoRA adapters on")
    found = experts_modules(model, info) if experts and cheap_experts else []
    cheap = bool(found) and all(unsupported_reason(m) is None for _, m in found)
    if cheap and not attention:
        model.requires_grad_(False)
        peft_model = model
    else:
        config = LoraConfig(
            r=r,
            lora_alpha=alpha,
            target_modules=attention or None,
            target_parameters=None if cheap else experts or None,
        )
        peft_model = get_peft_model(model, config)
    if cheap:
        add_expert_lora(peft_model, info, r, alpha)
    snapshot = router_snapshot(info)
    if train_router:
        for layer in info.layers:
            layer.router.weight.requires_grad_(True)
    return peft_model, snapshot


def router_snapshot(info: ModelInfo) -> list[Tensor]:
    return [layer.router.weight.detach().clone() for layer in info.layers]


@contextmanager
def teacher_mode(model: nn.Module, info: ModelInfo, snapshot: list[Tensor] | None) -> Iterator[None]:
    """Run the enclosed forward passes as the original model (adapters off, original routers)."""
    disable = (
        model.disable_adapter()
        if hasattr(model, "disable_adapter") and hasattr(model, "peft_config")
        else nullcontext()
    )
    saved: list[Tensor] = []
    with torch.no_grad(), disable, expert_lora_disabled(model):
        if snapshot is not None:
            for layer, w in zip(info.layers, snapshot, strict=False):
                saved.append(layer.router.weight.detach().clone())
                layer.router.weight.copy_(w)
        try:
            yield
        finally:
            for layer, w in zip(info.layers, saved, strict=False):
                layer.router.weight.copy_(w)
