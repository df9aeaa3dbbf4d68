"""``nn.Linear`` layers that run :mod:`moectl.kernels.bf16_rows` where it applies.

:func:`install` gives every ``nn.Linear`` of a model (attention projections, routers, shared
experts, the LM head) a forward that checks, at each call, whether the product is a bf16 one on the
CPU with no gradient wanted and the kernel built (``bf16_rows.applies``); otherwise it is
``nn.Linear``'s own. The layers stay ``nn.Linear`` instances (their class becomes a subclass), so
PEFT, ``state_dict`` and ``.to(...)`` see no difference. Decoding OLMoE-1B-7B reads ≈ 0.7 of its
≈ 2.3 GB per token through such layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moectl.kernels import bf16_rows


class CpuBf16Linear(nn.Linear):
    """An ``nn.Linear`` whose bf16 CPU products run :func:`moectl.kernels.bf16_rows.linear`."""

    def forward(self, x: Tensor) -> Tensor:
        if bf16_rows.applies(x, self.weight):
            return bf16_rows.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def install(model: nn.Module) -> int:
    """Give ``model``'s plain ``nn.Linear`` layers that hold bf16 weights on the CPU
    :class:`CpuBf16Linear`'s forward (idempotent; layers of other subclasses are left alone); returns
    how many were changed. The kernel is built at the first product that uses it."""
    changed = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if type(module) is nn.Linear and weight.dtype == torch.bfloat16 and weight.device.type == "cpu":
            module.__class__ = CpuBf16Linear
            changed += 1
    return changed
