"""Bad input is refused with an error that names what was wrong and what is allowed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import moectl
from conftest import random_ids
from moectl.adapters.slicing import check_keep
from moectl.routing import DocumentPool, ExpertMask, GumbelTopK, route


@pytest.fixture
def info(olmoe):
    return moectl.inspect(olmoe)


def test_mask_with_fewer_than_top_k(olmoe, info):
    with (
        pytest.raises(ValueError, match="fewer than top-k = 2"),
        route(olmoe, ExpertMask.from_lists(info, {0: [3]})),
    ):
        pass


def test_mask_wrong_expert_count(olmoe):
    with (
        pytest.raises(ValueError, match="has 8 experts"),
        route(olmoe, ExpertMask({0: torch.ones(5, dtype=torch.bool)})),
    ):
        pass


def test_mask_wrong_rank_and_values():
    with pytest.raises(ValueError, match=r"allowed shapes are \[E\], \[B, E\], \[B, T, E\]"):
        ExpertMask({0: torch.ones(1, 1, 1, 8, dtype=torch.bool)})
    with pytest.raises(ValueError, match="boolean or 0/1"):
        ExpertMask({0: torch.tensor([0, 2, 1, 1, 1, 1, 1, 1])})
    with pytest.raises(ValueError, match="renorm must be one of"):
        ExpertMask({}, renorm="softmax")


def test_mask_ids_out_of_range_and_duplicates(info):
    with pytest.raises(ValueError, match=r"out of range; valid ids are 0..7"):
        ExpertMask.from_lists(info, {0: [0, 9]})
    with pytest.raises(ValueError, match="duplicate"):
        ExpertMask.from_lists(info, {0: [1, 1, 2]})
    with pytest.raises(IndexError, match=r"MoE layers 0\.\.2"):
        ExpertMask.from_lists(info, {7: [0, 1]})


def test_batch_mask_wrong_batch(olmoe, info):
    mask = ExpertMask({0: torch.ones(3, 8, dtype=torch.bool)})
    with pytest.raises(ValueError, match="B=3, batch is 2"), route(olmoe, mask):
        olmoe(random_ids(batch=2))


def test_token_mask_too_short(olmoe):
    mask = ExpertMask({0: torch.ones(2, 4, 8, dtype=torch.bool)})
    with pytest.raises(ValueError, match="does not cover"), route(olmoe, mask):
        olmoe(random_ids(batch=2, length=6))


def test_grouped_mask_must_reach_top_k():
    model = moectl.tiny("deepseek_v3")  # 2 groups of 4, router keeps 1 group, top-2
    info = moectl.inspect(model)
    # one allowed expert in each group: the kept group offers only one allowed expert
    with (
        pytest.raises(ValueError, match="surely reachable"),
        route(model, ExpertMask.from_lists(info, {0: [0, 4]})),
    ):
        pass
    with route(model, ExpertMask.from_lists(info, {0: [0, 1]}), record=True) as session:
        model(random_ids())
    assert torch.isin(session.trace.chosen[0], torch.tensor([0, 1])).all()


def test_negative_or_misshapen_temperature(olmoe):
    for tau in (-0.1, float("nan")):
        with pytest.raises(ValueError, match="must be >= 0"), route(olmoe, GumbelTopK(tau)):
            pass
    with (
        pytest.raises(ValueError, match="2 temperatures given, the model has 3 MoE layers"),
        route(olmoe, GumbelTopK([0.1, 0.2])),
    ):
        pass
    with pytest.raises(ValueError, match=r"MoE layers 0\.\.2"), route(olmoe, GumbelTopK({5: 0.1})):
        pass


def test_pool_size_bounds(olmoe):
    for d in (1, 9):
        with pytest.raises(ValueError, match=r"top-k <= d <= E"), route(olmoe, DocumentPool(d)):
            pass
    with pytest.raises(ValueError, match="'causal' or 'full'"):
        DocumentPool(4, mode="prefix")


def test_k_hat_below_top_k():
    from moectl.metrics.switch_rate import router_option_masks

    probs = torch.rand(1, 5, 8)
    chosen = torch.zeros(1, 5, 8, dtype=torch.bool)
    chosen[..., :2] = True
    with pytest.raises(ValueError, match="smaller than top-k = 2"):
        router_option_masks(probs, chosen, k_hat=1)


def test_not_a_policy(olmoe):
    with pytest.raises(TypeError, match="not a routing policy"):
        route(olmoe, [object()])


def test_unknown_router_fails_closed():
    class MysteryRouter(nn.Module):
        def forward(self, x):
            return x

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = MysteryRouter()

    with pytest.raises(
        moectl.UnsupportedModelError, match=r"MysteryRouter.*supported routers: .*OlmoeTopKRouter"
    ):
        moectl.inspect(Model())


def test_use_kernels_refused(olmoe):
    olmoe._use_kernels = True
    try:
        with pytest.raises(moectl.UnsupportedModelError, match="use_kernels"):
            moectl.inspect(olmoe)
    finally:
        olmoe._use_kernels = False


def test_bypassed_router_detected():
    model = moectl.tiny("olmoe")
    block = model.model.layers[1].mlp
    original = block.forward

    def fused(hidden_states):  # a "kernel" that never calls the router module
        return hidden_states * 0

    block.forward = fused
    info = moectl.inspect(model)
    with (
        pytest.raises(moectl.UnsupportedModelError, match=r"MoE layers \[1\] were not called"),
        route(model, ExpertMask.everywhere(info, range(4))),
    ):
        model(random_ids())
    block.forward = original


def test_keep_lists_checked(info):
    with pytest.raises(ValueError, match="missing layers"):
        check_keep(info, {0: [0, 1]})
    with pytest.raises(ValueError, match="same number"):
        check_keep(info, {0: [0, 1], 1: [0, 1, 2], 2: [0, 1]})
    with pytest.raises(ValueError, match="fewer than top-k"):
        check_keep(info, {0: [0], 1: [0], 2: [0]})


def test_intersection_of_masks_with_too_few_experts(olmoe, info):
    first = ExpertMask.from_lists(info, {0: [0, 1, 2]})
    second = ExpertMask.from_lists(info, {0: [2, 3, 4]})
    with pytest.raises(ValueError, match="combined policies, MoE layer 0"), route(olmoe, [first, second]):
        olmoe(random_ids())
