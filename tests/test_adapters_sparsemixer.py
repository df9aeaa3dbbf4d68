"""Phi-MoE's sparsemixer rule: equal to transformers' eval path; masks and noise act as documented."""

from __future__ import annotations

import torch
from transformers.models.phimoe.modeling_phimoe import sparsemixer as source_sparsemixer

import moectl
from conftest import random_ids
from moectl.adapters.rules import RouterRule
from moectl.adapters.sparsemixer import sparsemixer
from moectl.routing import ExpertMask, route


def _logits(n: int = 256, e: int = 8, seed: int = 0) -> torch.Tensor:
    g = torch.randn(n, e, generator=torch.Generator().manual_seed(seed))
    g[:16] = g[:16].round()  # ties and exact zeros
    g[16:32] -= 3.0  # all negative: the threshold's factor is |g|
    return g


def test_equals_the_source_at_inference():
    logits = _logits()
    for eps in (0.01, 0.3, 1.0):
        ref_w, ref_i = source_sparsemixer(logits, jitter_eps=eps, training=False)
        weights, idx = sparsemixer(logits, eps)
        assert torch.equal(idx, ref_i)
        torch.testing.assert_close(weights, ref_w, rtol=0, atol=0)


def test_threshold_in_the_routers_dtype_equals_the_source_in_bf16():
    logits = _logits().bfloat16()
    ref_w, ref_i = source_sparsemixer(logits, jitter_eps=0.3, training=False)
    weights, idx = sparsemixer(logits.float(), 0.3, threshold_dtype=torch.bfloat16)
    assert torch.equal(idx, ref_i)
    torch.testing.assert_close(weights, ref_w.float(), rtol=0, atol=2 * torch.finfo(torch.bfloat16).eps)
    float32_w, _ = sparsemixer(logits.float(), 0.3)  # deciding in float32 flips some thresholds
    assert (float32_w - ref_w.float()).abs().max() > 0.05


def test_rule_dispatches_and_p_is_the_softmax():
    rule = RouterRule(kind="sparsemixer", top_k=2, num_experts=8, jitter_eps=0.3)
    logits = _logits()
    assert all(torch.equal(a, b) for a, b in zip(rule.select(logits), sparsemixer(logits, 0.3), strict=True))
    torch.testing.assert_close(rule.probs(logits), torch.softmax(logits, -1))


def test_pruned_mask_equals_the_rule_on_the_kept_experts():
    logits, keep = _logits(), torch.tensor([1, 2, 5, 6])
    allowed = torch.zeros(8, dtype=torch.bool)
    allowed[keep] = True
    weights, idx = sparsemixer(logits, 0.3, allowed.expand(len(logits), -1), renorm="pruned")
    ref_w, ref_i = source_sparsemixer(logits[:, keep], jitter_eps=0.3, training=False)
    assert torch.equal(idx, keep[ref_i])
    torch.testing.assert_close(weights, ref_w)


def test_stock_mask_keeps_disallowed_experts_in_the_softmax():
    # expert 0 is the best but disallowed; expert 1 is picked, and 0 lies within its threshold
    logits = torch.tensor([[2.0, 1.9, -5.0, -6.0]])
    allowed = torch.tensor([[False, True, True, True]])
    stock_w, stock_i = sparsemixer(logits, 0.5, allowed, renorm="stock")
    pruned_w, pruned_i = sparsemixer(logits, 0.5, allowed, renorm="pruned")
    assert stock_i.tolist() == pruned_i.tolist() == [[1, 2]]
    torch.testing.assert_close(stock_w[0, 0], torch.softmax(logits[0, :2], -1)[1])  # 0 shares the softmax
    assert pruned_w[0, 0] == 1.0  # 0 sliced out: 1 is alone within its threshold


def test_noise_picks_on_noisy_logits_and_weights_from_the_clean_ones():
    logits = _logits()
    zero = sparsemixer(logits, 0.3, noise=torch.zeros_like(logits))
    assert all(torch.equal(a, b) for a, b in zip(zero, sparsemixer(logits, 0.3), strict=True))
    noise = torch.zeros_like(logits)
    noise[:, 7] = 100.0  # expert 7 always picked first
    weights, idx = sparsemixer(logits, 0.3, noise=noise)
    assert (idx[:, 0] == 7).all() and (idx[:, 1] != 7).all()
    # its weight: the clean softmax over the experts within the threshold of its own clean logit
    centre = logits[:, 7:]
    outside = (centre - logits) / logits.abs().clamp(min=centre) > 0.6
    want = torch.softmax(logits.masked_fill(outside, float("-inf")), -1)[:, 7]
    torch.testing.assert_close(weights[:, 0], want)


@torch.no_grad()
def test_phimoe_model_masks_hold_and_self_test_passes_in_bf16():
    model = moectl.tiny("phimoe")
    info = moectl.inspect(model)
    assert info.family == "phimoe" and info.top_k == 2 and info.layers[0].rule.kind == "sparsemixer"
    with route(model, ExpertMask.everywhere(info, [0, 3, 5]), record=True) as session:
        model(random_ids())
    for chosen in session.trace.chosen.values():
        assert torch.isin(chosen, torch.tensor([0, 3, 5])).all()
    assert moectl.self_test(moectl.tiny("phimoe").to(torch.bfloat16)).passed
