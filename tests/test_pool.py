"""DocumentPool (EMO §3.2) against a slow per-document reference, and in generation."""

from __future__ import annotations

import pytest
import torch

import moectl
from conftest import random_ids
from moectl.adapters.rules import RouterRule
from moectl.routing import DocumentPool, route
from moectl.routing.state import RouteContext, RoutingState

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
        cache = out.past_key_values
        for pos in range(6, 10):
            out = olmoe(ids[:, pos : pos + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
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
    info = moectl.inspect(model)
    if info.layers[0].rule.grouped:
        pytest.skip("document pools on grouped routers may leave a kept group empty; checked at run time")
    with route(model, DocumentPool(4, "causal"), record=True) as session:
        model(random_ids(batch=2, length=12))
    for layer, chosen in session.trace.chosen.items():
        assert session.trace.allowed[layer].gather(-1, chosen).all()
