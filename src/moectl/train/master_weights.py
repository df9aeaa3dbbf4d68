"""float32 master copies of the half-precision parameters a run trains.

Mixed-precision training keeps a float32 master of every trained weight, steps the master and
writes its rounding back into the half-precision model (Micikevicius et al. 2018, "Mixed Precision
Training", §3.1). Without it, AdamW's updates are rounded in bf16: an update of ≈ lr is below
bf16's spacing at a weight's size (8 significant bits: spacing ≈ 1.2e-4 at 0.02), so most vanish.
Measured (``benchmarks/master_weights.py``): four full fine-tuning steps of the reference model at
lr 5e-5 changed 100% of its weights in float32 and 13% of them in bf16. Used where moectl trains a
bf16 model's own weights: ``moectl subset finetune`` without LoRA (EMO appendix C) and the routers
of ``moectl options train`` (TE-MoE §4.3's intra-option step). Adapters need none: they are float32 already (PEFT's
``autocast_adapter_dtype``; ``options.expert_lora.adapter_dtype``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

HALF = (torch.bfloat16, torch.float16)


class MasterWeights:
    """The optimizer's view of ``params``: float32 parameters as they are, a float32 master in
    place of each half-precision one (``enabled=False``: every parameter as it is). Around
    ``optimizer.step()``: :meth:`to_masters` moves the gradients onto the masters, :meth:`to_model`
    writes the stepped masters back."""

    def __init__(self, params: list[nn.Parameter], enabled: bool = True) -> None:
        self.params = list(params)
        self.masters = {
            i: p.detach().float().clone() for i, p in enumerate(self.params) if enabled and p.dtype in HALF
        }

    def optimizer_params(self) -> list[Tensor]:
        return [self.masters.get(i, p) for i, p in enumerate(self.params)]

    def to_masters(self) -> None:
        """Each half-precision gradient, in float32, onto its master (the model's is dropped)."""
        for i, master in self.masters.items():
            p = self.params[i]
            master.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    @torch.no_grad()
    def to_model(self) -> None:
        """The masters' values, rounded, into the model's parameters."""
        for i, master in self.masters.items():
            self.params[i].copy_(master)

    def state_dict(self) -> dict[int, Tensor]:
        return {i: m.detach().cpu().clone() for i, m in self.masters.items()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[int, Tensor] | None) -> None:
        """Masters from a checkpoint (None: from the model's parameters, for a checkpoint without
        them); the model's parameters then follow them."""
        for i, master in self.masters.items():
            master.copy_(self.params[i].float() if state is None else state[i])
        self.to_model()
