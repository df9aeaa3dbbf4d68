"""Bare-Linear routers in remote-code blocks (EMO): every routing path re-routed, masked and sliced exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

import moectl
from conftest import random_ids
from moectl.adapters.linear_gate import GateRouter, observed_weights
from moectl.adapters.slicing import slice_experts
from moectl.models.tiny_emo import EmoSparseMoeBlock
from moectl.routing import ExpertMask, GumbelTopK, route

# the three routing paths of EMO's block; top-k counts shared / always-active experts, as EMO does
PATHS = {
    "shared": {},  # the released checkpoints' layout: last expert shared, own softmax
    "always_active": {"num_shared_experts": 0, "always_active_experts": [2]},
    "plain": {"num_shared_experts": 0, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True},
}


def _emo(path: str, **overrides) -> nn.Module:
    return moectl.tiny("emo", **PATHS[path], **overrides)


@pytest.fixture(params=list(PATHS))
def path(request) -> str:
    return request.param


@torch.no_grad()
def test_inspect_and_self_test(path):
    model = _emo(path)
    info = moectl.inspect(model)
    shared = {"shared": [8], "always_active": [2], "plain": []}[path]
    assert info.family == "emo" and info.num_moe_layers == 3 and info.num_experts == 8
    assert info.top_k == model.config.num_experts_per_tok - len(shared)
    assert info.summary()["shared_experts"] == [len(shared)]
    router = info.layers[0].router
    assert isinstance(router, GateRouter) and router.gate is model.model.layers[0].mlp.gate
    assert router.weight is router.gate.weight and info.layers[0].name == "model.layers.0.mlp.gate"
    assert router.routed_ids().tolist() == [e for e in range(router.gate.out_features) if e not in shared]
    result = moectl.self_test(model, info)
    assert result.passed and result.layers_checked == 3, str(result)


@torch.no_grad()
def test_observed_weights_are_the_blocks_own():
    block = _emo("shared").model.layers[0].mlp
    hidden = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0))
    logits = block.gate(hidden.reshape(-1, 64))
    weights, idx = block._route(logits)
    want = torch.zeros(10, 9).scatter_(1, idx, weights)
    torch.testing.assert_close(observed_weights(block, hidden), want)
    assert (observed_weights(block, hidden)[:, 8] == 1).all()  # one shared expert: weight 1


@torch.no_grad()
def test_routing_session_reproduces_and_leaves_the_block_untouched(path):
    model = _emo(path)
    info = moectl.inspect(model)
    blocks = [layer.block for layer in info.layers]
    keys = list(model.state_dict())
    ids = random_ids()
    ref = model(ids).logits
    for renorm in ("pruned", "stock"):
        with route(model, ExpertMask.everywhere(info, range(8), renorm=renorm), record=True):
            assert all("forward" in block.__dict__ for block in blocks)  # driven while hooked
            out = model(ids).logits
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    with route(model, GumbelTopK(0.0), record=True):  # selection unchanged: the block's own numbers, exactly
        assert torch.equal(model(ids).logits, ref)
    assert all("forward" not in block.__dict__ for block in blocks)
    assert list(model.state_dict()) == keys
    assert not any(isinstance(m, GateRouter) for m in model.modules())
    assert torch.equal(model(ids).logits, ref)


@torch.no_grad()
def test_masks_restrict_routed_experts_and_keep_the_shared_ones(path):
    model = _emo(path)
    info = moectl.inspect(model)
    keep = [1, 3, 4, 6]
    shared = info.layers[0].router.family.shared(info.layers[0].block)
    calls = {e: 0 for e in range(9)}
    experts = info.layers[0].block.experts
    handles = [
        expert.register_forward_hook(lambda m, a, o, e=e: calls.__setitem__(e, calls[e] + a[0].shape[0]))
        for e, expert in enumerate(experts)
    ]
    ids = random_ids(batch=3, length=10)
    try:
        with route(model, ExpertMask.everywhere(info, keep), record=True) as session:
            model(ids)
    finally:
        for handle in handles:
            handle.remove()
    for chosen in session.trace.chosen.values():
        assert chosen.shape == (3, 10, info.top_k) and torch.isin(chosen, torch.tensor(keep)).all()
    block_ids = info.layers[0].router.routed_ids()[torch.tensor(keep)].tolist()
    used = {e for e, n in calls.items() if n}
    assert used <= set(block_ids) | set(shared)
    assert all(calls[e] == 30 for e in shared)  # every token still uses its shared / always-active expert


@torch.no_grad()
def test_sliced_model_equals_pruned_mask_and_round_trips(path, tmp_path):
    model = _emo(path)
    info = moectl.inspect(model)
    keep = {0: [1, 3, 4, 6], 1: [0, 2, 5, 7], 2: [2, 3, 6, 7]}
    ids = random_ids()
    with route(model, ExpertMask.from_lists(info, keep, renorm="pruned")):
        ref = model(ids).logits
    slice_experts(model, keep, info)
    sliced = moectl.inspect(model)
    assert sliced.num_experts == 4 and moectl.self_test(model, sliced).passed
    torch.testing.assert_close(model(ids).logits, ref, rtol=1e-5, atol=1e-5)
    if path == "always_active":  # expert 2 is now at position 1 in layers 0 and 1, 0 in layer 2
        assert [layer.block.always_active_experts for layer in sliced.layers] == [[1], [1], [0]]
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(loaded(ids).logits, ref, rtol=1e-5, atol=1e-5)


def test_refusals():
    model = _emo("shared")
    model.config.ghost_extend_eval = True
    model.model.layers[0].mlp.ghost_extend_eval = True
    with pytest.raises(moectl.UnsupportedModelError, match="ghost_extend_eval"):
        moectl.inspect(model)
    model = _emo("shared")
    model.model.layers[1].mlp.gate = nn.Sequential(nn.Linear(64, 9, bias=False))
    with pytest.raises(moectl.UnsupportedModelError, match=r"bare nn\.Linear `gate`"):
        moectl.inspect(model)


def test_unregistered_remote_block_fails_closed():
    model = _emo("shared")
    mystery = type("MysteryMoeBlock", (nn.Module,), {k: v for k, v in vars(EmoSparseMoeBlock).items()})
    for layer in model.model.layers:
        layer.mlp.__class__ = mystery
    with pytest.raises(
        moectl.UnsupportedModelError,
        match=r"MysteryMoeBlock.*supported routers: .*EmoSparseMoeBlock\.gate \(emo",
    ):
        moectl.inspect(model)
