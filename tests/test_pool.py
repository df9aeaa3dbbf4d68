"""DocumentPool (EMO §3.2) against a slow per-document reference, and in generation."""

from __future__ import annotations

import pytest
import torch

import moectl
from conftest import random_ids
from moectl.adapters.rules import RouterRule
from moectl.routing import DocumentPool, route
from moectl.routing.kv_cache import cache_out, with_cache
from moectl.routing.routing_state import RouteContext, RoutingState

RULE = RouterRule(kind="softmax_topk", top_k=2, num_experts=8)


def _reference(probs, valid, doc_ids, d, mode):
    b, t, e = probs.shape
    pool = torch.zeros(b, t, e, dtype=torch.bool)
    for row in range(b):
        for pos in range(t):
            same = doc_ids[row] == doc_ids[row, pos]
            upto = torch.arange(t) <= pos if mode == "causal" else torch.ones(t, dtype=torch.bool)
            members = same & upto & valid[row]
            # documents are contiguous runs in these fixtures
            mean = probs[row][members].sum(0) / max(int(members.sum()), 1)
            pool[row, pos, mean.topk(d).indices] = True
    return pool


@pytest.mark.parametrize("mode", ["causal", "full"])
def test_pool_equals_reference_with_packed_documents(mode):
    generator = torch.Generator().manual_seed(0)
    b, t, e, d = 3, 17, 8, 3
    logits = torch.randn(b, t, e, generator=generator) * 2
    doc_ids = torch.tensor([[0] * 5 + [1] * 7 + [2] * 5, [0] * 17, [0] * 2 + [1] * 2 + [2] * 13])
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[2, 4:6] = False
    state = RoutingState(0, logits, RULE, RouteContext(batch=b, length=t, valid=valid))
    policy = DocumentPool(d, mode=mode, doc_ids=doc_ids)
    policy.apply(state)
    expected = _reference(torch.softmax(logits, -1), valid, doc_ids, d, mode)
    assert torch.equal(state.allowed, expected)


def test_full_pool_is_shared_within_document():
    logits = torch.randn(2, 9, 8)
    doc_ids = torch.tensor([[0] * 4 + [1] * 5, [3] * 9])
    state = RoutingState(0, logits, RULE, RouteContext(batch=2, length=9))
    DocumentPool(4, mode="full", doc_ids=doc_ids).apply(state)
    pool = state.allowed
    assert (pool[0, :4] == pool[0, :1]).all() and (pool[0, 4:] == pool[0, 4:5]).all()
    assert (pool[1] == pool[1, :1]).all()
    assert pool.sum(-1).eq(4).all()


@torch.no_grad()
def test_causal_pool_in_generation_equals_one_forward(olmoe):
    """Carrying the prefix sums across decoding steps gives the same pools as one causal forward."""
    ids = random_ids(batch=2, length=10)
    with route(olmoe, DocumentPool(3, "causal"), record=True) as whole:
        olmoe(ids)
    with route(olmoe, DocumentPool(3, "causal"), record=True) as stepwise:
        out = olmoe(ids[:, :6], use_cache=True)
        cache = cache_out(out)
        for pos in range(6, 10):
            out = olmoe(ids[:, pos : pos + 1], **with_cache(cache), use_cache=True)
            cache = cache_out(out)
    for layer in range(3):
        assert torch.equal(whole.trace.allowed[layer], stepwise.trace.allowed[layer])
        assert torch.equal(whole.trace.chosen[layer], stepwise.trace.chosen[layer])


@torch.no_grad()
def test_pool_respects_padding(olmoe):
    """Left padding does not enter the pool mean: a padded row pools like the unpadded one."""
    ids = random_ids(batch=1, length=8)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    attn = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 8, dtype=torch.long)], dim=1)
    with route(olmoe, DocumentPool(3, "full"), record=True) as plain:
        olmoe(ids)
    with route(olmoe, DocumentPool(3, "full"), record=True) as pad:
        olmoe(padded, attention_mask=attn)
    # layer 0 sees identical hidden states for the real tokens (positions shift, RoPE is relative)
    probs_plain = plain.trace.probs[0][0]
    probs_pad = pad.trace.probs[0][0, 3:]
    torch.testing.assert_close(probs_pad, probs_plain, rtol=1e-4, atol=1e-5)
    assert torch.equal(pad.trace.allowed[0][0, 3:], plain.trace.allowed[0][0])


def test_pool_chosen_inside(model):
    """Every family, grouped routers included: the pool never leaves a token short (no mid-forward error)."""
    info = moectl.inspect(model)
    with route(model, DocumentPool(4, "causal"), record=True) as session:
        model(random_ids(batch=2, length=12))
    for layer, chosen in session.trace.chosen.items():
        assert session.trace.allowed[layer].gather(-1, chosen).all()
        rule = info.layer(layer).rule
        if rule.grouped:  # the pool lies within the router's topk_group groups
            groups = session.trace.allowed[layer].reshape(2, 12, rule.n_group, -1).any(-1).sum(-1)
            assert bool((groups <= rule.topk_group).all())


def test_grouped_router_pool_is_group_limited_and_refuses_too_large_d():
    model = moectl.tiny("deepseek_v3")  # 8 experts in 2 groups, the router keeps 1 group, top-2
    info = moectl.inspect(model)
    rule = info.layers[0].rule
    assert rule.grouped and (rule.n_group, rule.topk_group) == (2, 1)
    for mode in ("causal", "full"):
        with route(model, DocumentPool(4, mode), record=True) as session:
            model(random_ids(batch=3, length=16, seed=1))
        for layer in session.trace.allowed:
            allowed = session.trace.allowed[layer]
            assert bool((allowed.sum(-1) == 4).all())
            assert bool((allowed.reshape(3, 16, 2, 4).any(-1).sum(-1) == 1).all())
    too_large = r"topk_group \* E / n_group.*keeps 1 of 2 expert groups.*allowed d: 2\.\.4"
    with pytest.raises(ValueError, match=too_large), route(model, DocumentPool(5)):
        pass


def test_pool_means_are_exact_at_the_end_of_a_long_packed_row():
    """A 12-token document after 16k packed tokens pools as it does alone (float32 prefix sums lost 2.6e-5)."""
    generator = torch.Generator().manual_seed(0)
    t_long, t_doc, e = 16_384, 12, 8
    logits = torch.randn(1, t_long, e, generator=generator) * 3
    doc_ids = torch.zeros(1, t_long, dtype=torch.long)
    doc_ids[0, -t_doc:] = 1
    rule = RouterRule(kind="softmax_topk", top_k=2, num_experts=e)
    from moectl.routing.pool import full_means, prefix_means

    p = torch.softmax(logits, -1)
    valid = torch.ones(1, t_long, dtype=torch.bool)
    alone = p[:, -t_doc:].double()
    for means, expected in (
        (prefix_means, alone.cumsum(1) / torch.arange(1, t_doc + 1, dtype=torch.float64)[None, :, None]),
        (full_means, alone.mean(1, keepdim=True).expand(1, t_doc, e)),
    ):
        sums, counts = means(p, valid, doc_ids)
        got = (sums / counts)[:, -t_doc:]
        assert (got - expected).abs().max() < 1e-12
    for mode in ("causal", "full"):
        packed = RoutingState(0, logits, rule, RouteContext(batch=1, length=t_long))
        DocumentPool(3, mode=mode, doc_ids=doc_ids).apply(packed)
        single = RoutingState(0, logits[:, -t_doc:], rule, RouteContext(batch=1, length=t_doc))
        DocumentPool(3, mode=mode).apply(single)
        assert torch.equal(packed.allowed[:, -t_doc:], single.allowed)
