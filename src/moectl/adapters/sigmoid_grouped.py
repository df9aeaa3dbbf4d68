"""Sigmoid routers with a score-correction bias and group-limited top-k (DeepSeek-V3 style).

s = sigmoid(g); groups ranked by the sum of their two best s + b; the ``topk_group`` best groups
kept; indices = top-k of s + b within them; weights = s[indices], renormalised when
``norm_topk_prob``, times ``routed_scaling_factor``. The bias only chooses, never weights.
"""

from __future__ import annotations

from torch import nn

from moectl.adapters.registry import Adapter, register
from moectl.adapters.rules import RouterRule

M = "transformers.models"


def _rule(module: nn.Module) -> RouterRule:
    return RouterRule(
        kind="sigmoid_topk",
        top_k=int(module.top_k),
        num_experts=int(module.num_experts),
        norm_topk_prob=bool(module.norm_topk_prob),
        renorm_eps=1e-20,
        scaling=float(module.routed_scaling_factor),
        n_group=int(module.num_group),
        topk_group=int(module.topk_group),
    )


for path, cls, family in [
    (f"{M}.deepseek_v3.modeling_deepseek_v3", "DeepseekV3TopkRouter", "deepseek_v3"),
    (f"{M}.glm4_moe.modeling_glm4_moe", "Glm4MoeTopkRouter", "glm4_moe"),
    (f"{M}.dots1.modeling_dots1", "Dots1TopkRouter", "dots1"),
]:
    register(
        path,
        cls,
        Adapter(family=family, build_rule=_rule, bias=lambda module: module.e_score_correction_bias),
    )
