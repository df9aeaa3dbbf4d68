"""Every family: the adapter reproduces the router, policies act, and leave no trace on exit."""

from __future__ import annotations

import pytest
import torch

import moectl
from conftest import random_ids
from moectl.adapters.slicing import slice_experts
from moectl.routing import ExpertMask, GumbelTopK, route


@torch.no_grad()
def test_self_test_passes(model):
    result = moectl.self_test(model)
    assert result.passed, str(result)
    assert result.index_mismatches == 0
    assert result.layers_checked == moectl.inspect(model).num_moe_layers


def test_inspect_reports_layers(model, family):
    info = moectl.inspect(model)
    summary = info.summary()
    assert info.num_experts == 8
    top_k = model.config.num_experts_per_tok if hasattr(model.config, "num_experts_per_tok") else 2
    if family == "emo":  # EMO's top_k counts its shared expert, which moectl leaves to the block
        top_k -= model.config.num_shared_experts
    assert summary["top_k"] == [top_k]
    assert sorted(summary["moe_layers"] + summary["dense_layers"]) == list(range(info.num_layers))
    if family in ("deepseek_v3", "deepseek_v2", "glm4_moe", "dots1", "ernie4_5_moe"):
        assert summary["dense_layers"] == [0]  # first layer dense in the tiny configs: skipped
    expected_shared = family in (
        "qwen2_moe",
        "qwen3_next",
        "deepseek_v3",
        "deepseek_v2",
        "emo",
        "glm4_moe",
        "dots1",
        "granitemoeshared",
        "ernie4_5_moe",
        "llama4_text",
        "hunyuan_v1_moe",
    )
    assert (summary["shared_experts"] != [0]) == expected_shared


@torch.no_grad()
def test_all_experts_allowed_reproduces_logits(model):
    info = moectl.inspect(model)
    ids = random_ids()
    ref = model(ids).logits
    for renorm in ("pruned", "stock"):
        with route(model, ExpertMask.everywhere(info, range(info.num_experts), renorm=renorm)):
            out = model(ids).logits
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_random_mask_chosen_inside(model):
    info = moectl.inspect(model)
    generator = torch.Generator().manual_seed(1)
    masks = {}
    for layer in info.layers:
        if layer.rule.n_group > 1:  # grouped: keep 2 experts in each group so every group stays reachable
            size = layer.num_experts // layer.rule.n_group
            ids = [
                g * size + i
                for g in range(layer.rule.n_group)
                for i in torch.randperm(size, generator=generator)[:2].tolist()
            ]
        else:
            ids = torch.randperm(layer.num_experts, generator=generator)[: layer.top_k + 1].tolist()
        masks[layer.index] = ids
    policy = ExpertMask.from_lists(info, masks)
    with route(model, policy, record=True) as session:
        model(random_ids(batch=3, length=10))
    for index, ids in masks.items():
        chosen = session.trace.chosen[index]
        assert chosen.shape == (3, 10, info.layer(index).top_k)
        assert torch.isin(chosen, torch.tensor(ids)).all(), f"layer {index} used experts outside {ids}"
        assert session.trace.allowed[index].sum(-1).eq(len(ids)).all()


@torch.no_grad()
def test_gumbel_tau_zero_is_identity(model):
    ids = random_ids()
    ref = model(ids).logits
    with route(model, GumbelTopK(0.0, seed=3), record=True) as session:
        out = model(ids).logits
    assert torch.equal(out, ref)
    with route(model, record=True) as plain:
        model(ids)
    for layer, chosen in plain.trace.chosen.items():
        assert torch.equal(session.trace.chosen[layer], chosen)


@torch.no_grad()
def test_gumbel_noise_changes_selection_but_not_weights_source(model):
    info = moectl.inspect(model)
    ids = random_ids(batch=2, length=16)
    with route(model, record=True) as plain:
        model(ids)
    with route(model, GumbelTopK(5.0, seed=0), record=True) as noisy:
        model(ids)
    changed = sum(
        int((noisy.trace.chosen[i].sort(-1).values != plain.trace.chosen[i].sort(-1).values).any(-1).sum())
        for i in range(info.num_moe_layers)
    )
    assert changed > 0
    # the first MoE layer sees unchanged inputs: its recorded p comes from the un-noised scores
    torch.testing.assert_close(noisy.trace.probs[0], plain.trace.probs[0])


@torch.no_grad()
def test_install_and_remove_leaves_model_untouched(model):
    info = moectl.inspect(model)
    ids = random_ids()
    ref = model(ids).logits
    hooks_before = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    keep = [0, 1, 4, 5] if info.layers[0].rule.n_group > 1 else [0, 1, 2]
    with route(model, [ExpertMask.everywhere(info, keep), GumbelTopK(1.0)], record=True):
        masked = model(ids).logits
    assert not torch.equal(masked, ref)
    hooks_after = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    assert hooks_after == hooks_before
    assert torch.equal(model(ids).logits, ref)


@torch.no_grad()
def test_session_removes_hooks_on_error(olmoe):
    info = moectl.inspect(olmoe)
    with pytest.raises(RuntimeError, match="boom"), route(olmoe, ExpertMask.everywhere(info, [0, 1, 2])):
        raise RuntimeError("boom")
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in olmoe.modules())


@torch.no_grad()
def test_sliced_model_equals_pruned_mask(family):
    model = moectl.tiny(family)
    info = moectl.inspect(model)
    keep = [0, 1, 4, 5] if info.layers[0].rule.n_group > 1 else [1, 3, 4, 6]
    ids = random_ids()
    with route(model, ExpertMask.everywhere(info, keep, renorm="pruned")):
        ref = model(ids).logits
    slice_experts(model, {layer.index: keep for layer in info.layers})
    assert moectl.inspect(model).num_experts == 4
    torch.testing.assert_close(model(ids).logits, ref, rtol=1e-5, atol=1e-5)
    assert moectl.self_test(model).passed


@torch.no_grad()
def test_stock_and_pruned_differ_without_renormalisation():
    model = moectl.tiny("olmoe")  # norm_topk_prob=False: the two modes must differ
    info = moectl.inspect(model)
    ids = random_ids()
    outs = {}
    for renorm in ("pruned", "stock"):
        with route(model, ExpertMask.everywhere(info, [1, 3, 4, 6], renorm=renorm)):
            outs[renorm] = model(ids).logits
    assert not torch.allclose(outs["pruned"], outs["stock"])
