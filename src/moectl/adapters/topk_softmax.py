"""Top-k → softmax routers: choose on the logits, weight by a softmax over the k chosen logits.

gpt-oss (with a router bias inside its logits) and Granite-MoE. Renormalisation modes coincide
here: the softmax over the chosen logits does not depend on the other experts.
"""

from __future__ import annotations

from torch import nn

from moectl.adapters.registry import Adapter, register
from moectl.adapters.rules import RouterRule

M = "transformers.models"


def _rule(module: nn.Module) -> RouterRule:
    return RouterRule(kind="topk_softmax", top_k=int(module.top_k), num_experts=int(module.num_experts))


for path, cls, family in [
    (f"{M}.gpt_oss.modeling_gpt_oss", "GptOssTopKRouter", "gpt_oss"),
    (f"{M}.granitemoe.modeling_granitemoe", "GraniteMoeTopKRouter", "granitemoe"),
    (f"{M}.granitemoeshared.modeling_granitemoeshared", "GraniteMoeSharedTopKRouter", "granitemoeshared"),
]:
    register(path, cls, Adapter(family=family, build_rule=_rule))
