"""DeepSeek-V2: greedy (V2-Lite) and group-limited greedy top-k, × routed_scaling_factor, as transformers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import moectl
from conftest import random_ids
from moectl.adapters.slicing import slice_experts
from moectl.routing import ExpertMask, route

# DeepSeek-V2-Lite's routing at tiny scale: greedy top-k, 2 shared experts, no scaling, no groups
V2_LITE = {"topk_method": "greedy", "n_group": None, "topk_group": None, "routed_scaling_factor": 1.0}


@torch.no_grad()
@pytest.mark.parametrize("overrides", [{}, V2_LITE], ids=["group_limited_greedy", "greedy"])
def test_self_test_masks_and_slicing(overrides):
    model = moectl.tiny("deepseek_v2", **overrides)
    info = moectl.inspect(model)
    rule = info.layers[0].rule
    assert info.family == "deepseek_v2" and info.summary()["shared_experts"] == [2]
    assert rule.grouped == (not overrides) and rule.group_topn == 1 and not rule.norm_topk_prob
    assert rule.scaling == model.config.routed_scaling_factor
    assert moectl.self_test(model, info).passed
    keep = [0, 2, 5, 7]  # two per group of four
    ids = random_ids()
    with route(model, ExpertMask.everywhere(info, keep), record=True) as session:
        masked = model(ids).logits
    assert all(torch.isin(c, torch.tensor(keep)).all() for c in session.trace.chosen.values())
    slice_experts(model, {layer.index: keep for layer in info.layers})
    torch.testing.assert_close(model(ids).logits, masked, rtol=1e-5, atol=1e-5)
    assert moectl.self_test(model).passed


def test_groups_ranked_by_their_best_expert():
    model = moectl.tiny("deepseek_v2")
    rule = moectl.inspect(model).layers[0].rule  # 2 groups of 4, keep 1 group, top-2
    # group 0 holds the best expert, group 1 the higher sum of its two best: V2 keeps group 0
    logits = torch.tensor([[3.0, 0.0, -9.0, -9.0, 2.5, 2.5, -9.0, -9.0]])
    weights, idx = rule.select(logits)
    assert sorted(idx[0].tolist()) == [0, 1]
    torch.testing.assert_close(weights, torch.softmax(logits, -1)[:, :2] * rule.scaling)
    _, idx = dataclasses.replace(rule, group_topn=2).select(logits)  # DeepSeek-V3's ranking differs
    assert sorted(idx[0].tolist()) == [4, 5]


def test_one_allowed_expert_per_group_reaches_a_group():
    rule = moectl.inspect(moectl.tiny("deepseek_v2")).layers[0].rule
    # ranked by the best allowed expert, every group with an allowed expert can win: 1 + 1 is not enough
    with pytest.raises(ValueError, match="surely reachable"):
        rule.check_allowed(torch.tensor([[True, False, False, False, True, False, False, False]]))
    rule.check_allowed(torch.tensor([[True, True, False, False, True, True, False, False]]))


def test_unknown_topk_method_is_refused():
    model = moectl.tiny("deepseek_v2")
    for layer in model.model.layers[1:]:
        layer.mlp.gate.topk_method = "noaux_tc"
    with pytest.raises(moectl.UnsupportedModelError, match="noaux_tc"):
        moectl.inspect(model)
