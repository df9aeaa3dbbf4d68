"""Property tests: random masks, temperatures and shapes never give NaN or leave the mask."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moectl
from moectl.adapters.rules import RouterRule
from moectl.routing import ExpertMask, GumbelTopK, route
from moectl.routing.gumbel import gumbel_noise

RULES = [
    RouterRule("softmax_topk", top_k=2, num_experts=8, norm_topk_prob=False),
    RouterRule("softmax_topk", top_k=2, num_experts=8, norm_topk_prob=True),
    RouterRule("topk_softmax", top_k=2, num_experts=8),
    RouterRule(
        "sigmoid_topk",
        top_k=2,
        num_experts=8,
        norm_topk_prob=True,
        renorm_eps=1e-20,
        scaling=2.5,
        n_group=2,
        topk_group=1,
    ),
    RouterRule("sigmoid_dense", top_k=1, num_experts=8),
]


@st.composite
def routing_inputs(draw):
    rule = draw(st.sampled_from(RULES))
    n = draw(st.integers(1, 24))
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    scale = draw(st.sampled_from([0.01, 1.0, 30.0]))
    logits = torch.randn(n, 8, generator=generator) * scale
    allowed = torch.rand(n, 8, generator=generator) < draw(st.floats(0.2, 1.0))
    # make every row valid for the rule: at least top-k allowed, inside one group for grouped rules
    allowed[:, : rule.top_k] = True
    if rule.grouped:
        allowed[:, 4:] = False
    tau = draw(st.sampled_from([0.0, 0.1, 1.0, 10.0]))
    noise = gumbel_noise(logits.shape, generator, logits.device) * tau if tau else None
    renorm = draw(st.sampled_from(["pruned", "stock"]))
    return rule, logits, allowed, noise, renorm


@settings(max_examples=300, deadline=None)
@given(routing_inputs())
def test_rule_selection_invariants(inputs):
    rule, logits, allowed, noise, renorm = inputs
    rule.check_allowed(allowed)
    weights, idx = rule.select(logits, None, allowed, noise, renorm)
    assert idx.shape == (logits.shape[0], rule.top_k) and weights.shape == idx.shape
    assert torch.isfinite(weights).all()
    assert (weights >= 0).all()
    assert allowed.gather(-1, idx).all(), "an expert outside the mask was chosen"
    assert (idx.sort(-1).values[:, 1:] != idx.sort(-1).values[:, :-1]).all(), "an expert was chosen twice"
    total = weights.sum(-1)
    if rule.kind == "topk_softmax" or (rule.kind == "softmax_topk" and rule.norm_topk_prob):
        torch.testing.assert_close(total, torch.ones_like(total))
    elif rule.kind == "sigmoid_topk" and rule.norm_topk_prob:
        # the stock rule adds 1e-20 to the denominator: rows whose scores underflow sum to less
        live = torch.sigmoid(logits).gather(-1, idx).sum(-1) > 1e-12
        torch.testing.assert_close(total[live], torch.full_like(total[live], rule.scaling))
    elif rule.kind == "softmax_topk":
        assert (total <= 1 + 1e-5).all()
        if renorm == "pruned":  # p renormalised over the allowed experts: the k weights are its entries
            p = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1)
            torch.testing.assert_close(weights, p.gather(-1, idx))
    else:
        assert (weights <= 1).all()  # sigmoid of a chosen logit


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 3),
    length=st.integers(1, 9),
    tau=st.floats(0.0, 3.0),
    mask_kind=st.sampled_from(["E", "BE", "BTE"]),
    seed=st.integers(0, 1000),
)
def test_session_with_random_masks_and_noise(batch, length, tau, mask_kind, seed):
    model = _olmoe()
    generator = torch.Generator().manual_seed(seed)
    shape = {"E": (8,), "BE": (batch, 8), "BTE": (batch, length, 8)}[mask_kind]
    allowed = torch.rand(shape, generator=generator) < 0.5
    allowed[..., :2] = True
    ids = torch.randint(3, 256, (batch, length), generator=generator)
    with (
        torch.no_grad(),
        route(model, [ExpertMask({1: allowed}), GumbelTopK(tau, seed=seed)], record=True) as session,
    ):
        logits = model(ids).logits
    assert torch.isfinite(logits).all()
    chosen = session.trace.chosen[1]
    recorded = session.trace.allowed[1]
    assert recorded.gather(-1, chosen).all()
    assert torch.equal(
        recorded,
        allowed.reshape(*([1] * (3 - allowed.dim())), *allowed.shape).expand(batch, length, 8)
        if mask_kind != "BE"
        else allowed[:, None].expand(batch, length, 8),
    )


_cache = {}


def _olmoe():
    if "m" not in _cache:
        _cache["m"] = moectl.tiny("olmoe")
    return _cache["m"]


def test_allowed_experts_with_underflowing_probabilities():
    """A disallowed expert that dominates p must not leave NaN or zero weights for the allowed ones."""
    logits = torch.tensor([[200.0, 0.0, -5.0, 1.0, -30.0, 2.0, 0.5, -1.0]])
    allowed = torch.tensor([[False, True, True, True, False, False, False, False]])
    for norm in (False, True):
        rule = RouterRule("softmax_topk", top_k=2, num_experts=8, norm_topk_prob=norm)
        weights, idx = rule.select(logits, allowed=allowed, renorm="pruned")
        assert sorted(idx[0].tolist()) == [1, 3]
        expected = torch.softmax(logits[0, [1, 2, 3]], -1)[[0, 2]]
        if norm:
            expected = expected / expected.sum()
        torch.testing.assert_close(weights[0].sort().values, expected.sort().values)
        stock_w, _ = rule.select(logits, allowed=allowed, renorm="stock")
        assert torch.isfinite(stock_w).all()
        if norm:
            torch.testing.assert_close(stock_w.sum(), torch.tensor(1.0))
