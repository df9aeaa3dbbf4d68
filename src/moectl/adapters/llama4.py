"""Llama 4's router: top-k of the logits, sigmoid of the chosen logits as weights.

It returns ``(scores, logits)`` with ``scores`` a dense [N, E] matrix (zero off the chosen
experts) that the block multiplies into every expert's input, so a re-routed output is the
dense scatter of the recomputed weights.
"""

from __future__ import annotations

from torch import nn

from moectl.adapters.registry import Adapter, register
from moectl.adapters.rules import RouterRule


def _rule(module: nn.Module) -> RouterRule:
    return RouterRule(kind="sigmoid_dense", top_k=int(module.top_k), num_experts=int(module.num_experts))


register(
    "transformers.models.llama4.modeling_llama4",
    "Llama4Router",
    Adapter(family="llama4_text", build_rule=_rule, output="llama4"),
)
