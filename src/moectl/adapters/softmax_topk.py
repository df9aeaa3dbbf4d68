"""Softmax → top-k routers, with or without renormalising the k weights.

p = softmax(g); indices = top-k of p (+ Ernie's score-correction bias); weights = p[indices],
divided by their sum when the family renormalises (``norm_topk_prob``).

DeepSeek-V2 (``DeepseekV2TopkRouter``) adds, as transformers implements it: ``topk_method``
``"greedy"`` (DeepSeek-V2-Lite) is the plain rule; ``"group_limited_greedy"`` first keeps the
``topk_group`` expert groups with the highest max p; weights are p[indices] × routed_scaling_factor,
never renormalised (transformers' router reads no ``norm_topk_prob``).
"""

from __future__ import annotations

from torch import nn

from moectl.adapters.registry import Adapter, register
from moectl.adapters.rules import RouterRule
from moectl.errors import UnsupportedModelError

M = "transformers.models"


def _rule(renorm: bool | None = None, eps: float = 0.0):
    """Rule builder; ``renorm=None`` reads the module's ``norm_topk_prob``."""

    def build(module: nn.Module) -> RouterRule:
        norm = bool(getattr(module, "norm_topk_prob", False)) if renorm is None else renorm
        return RouterRule(
            kind="softmax_topk",
            top_k=int(module.top_k),
            num_experts=int(module.num_experts),
            norm_topk_prob=norm,
            renorm_eps=eps,
        )

    return build


def _ernie_rule(module: nn.Module) -> RouterRule:
    return RouterRule(
        kind="softmax_topk",
        top_k=int(module.top_k),
        num_experts=int(module.num_experts),
        norm_topk_prob=True,
        renorm_min=float(module.norm_min),
    )


def _deepseek_v2_rule(module: nn.Module) -> RouterRule:
    method = module.topk_method
    if method not in ("greedy", "group_limited_greedy"):
        raise UnsupportedModelError(
            f"DeepSeek-V2 topk_method {method!r}: transformers implements 'greedy' and "
            "'group_limited_greedy' only, and so does moectl"
        )
    grouped = method == "group_limited_greedy"
    return RouterRule(
        kind="softmax_topk",
        top_k=int(module.top_k),
        num_experts=int(module.num_experts),
        scaling=float(module.routed_scaling_factor),
        n_group=int(module.num_group) if grouped else 1,
        topk_group=int(module.topk_group) if grouped else 1,
        group_topn=1,  # groups ranked by their best expert's p
    )


for path, cls, family, build in [
    (f"{M}.olmoe.modeling_olmoe", "OlmoeTopKRouter", "olmoe", _rule()),
    (f"{M}.flex_olmo.modeling_flex_olmo", "FlexOlmoTopKRouter", "flex_olmo", _rule()),
    (f"{M}.mixtral.modeling_mixtral", "MixtralTopKRouter", "mixtral", _rule(renorm=True)),
    (f"{M}.minimax.modeling_minimax", "MiniMaxTopKRouter", "minimax", _rule(renorm=True)),
    (f"{M}.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeTopKRouter", "qwen2_moe", _rule()),
    (f"{M}.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeTopKRouter", "qwen3_moe", _rule()),
    (f"{M}.qwen3_next.modeling_qwen3_next", "Qwen3NextTopKRouter", "qwen3_next", _rule()),
    (f"{M}.jamba.modeling_jamba", "JambaTopKRouter", "jamba", _rule(renorm=False)),
    (f"{M}.hunyuan_v1_moe.modeling_hunyuan_v1_moe", "HunYuanMoEV1Gate", "hunyuan_v1_moe", _rule(renorm=True)),
    (f"{M}.deepseek_v2.modeling_deepseek_v2", "DeepseekV2TopkRouter", "deepseek_v2", _deepseek_v2_rule),
]:
    register(path, cls, Adapter(family=family, build_rule=build))

register(
    f"{M}.ernie4_5_moe.modeling_ernie4_5_moe",
    "Ernie4_5_MoeTopKRouter",
    Adapter(
        family="ernie4_5_moe",
        build_rule=_ernie_rule,
        bias=lambda module: module.moe_statics.e_score_correction_bias.squeeze(0),
    ),
)
