"""Phi-MoE (Phi-3.5-MoE, ``PhimoeForCausalLM``): the sparsemixer router.

``PhimoeTopKRouter`` is an ``nn.Linear`` whose forward returns (logits, weights, indices) from
``sparsemixer`` (``adapters/sparsemixer.py``), so moectl hooks it like any transformers-5 router.
It always picks two experts; ``router_jitter_noise`` sets the threshold of its masked softmaxes,
decided in the router's dtype, as the source does.

Deviation: in training mode the source samples its picks (Gumbel) and jitters its input; moectl
recomputes the inference rule, so a routed Phi-MoE follows the eval rule in either mode.
"""

from __future__ import annotations

from torch import nn

from moectl.adapters.registry import Adapter, register
from moectl.adapters.rules import RouterRule


def _rule(module: nn.Module) -> RouterRule:
    return RouterRule(
        kind="sparsemixer",
        top_k=2,
        num_experts=int(module.num_experts),
        jitter_eps=float(module.router_jitter_noise),
        threshold_dtype=str(module.weight.dtype).removeprefix("torch."),
    )


register(
    "transformers.models.phimoe.modeling_phimoe",
    "PhimoeTopKRouter",
    Adapter(family="phimoe", build_rule=_rule),
)
