"""``pregate``: next-layer prediction from the next router, prefetches counted, tokens unchanged."""

from __future__ import annotations

import torch
from tests._serve_helpers import greedy

import moectl
from moectl.offload.pregate import PregateResidency, pregate_prediction
from moectl.offload.residency import parse_policy
from moectl.offload.runtime import offload


def test_prediction_is_the_next_routers_top_k():
    model = moectl.tiny("olmoe")
    layer = moectl.inspect(model).layers[1]
    hidden = torch.randn(64, generator=torch.Generator().manual_seed(0))
    probs = torch.softmax(hidden @ layer.router.weight.T, dim=-1)  # OLMoE: softmax, then top-2
    assert sorted(pregate_prediction(layer, hidden)) == sorted(probs.topk(2).indices.tolist())


def _serve(model, policy: str):
    ids = torch.tensor([[17]])
    with offload(model, 4, policy, store="host") as rt, moectl.route(model, rt.policy.routing(rt.info)):
        return greedy(model, ids, n=30), rt.totals(), rt.policy


def test_pregate_prefetches_the_next_layer_and_leaves_the_tokens_alone():
    model = moectl.tiny("olmoe")
    out_lru, _, _ = _serve(model, "lru")
    out, totals, policy = _serve(model, "pregate")
    assert torch.equal(out, out_lru)  # prefetching never changes routing
    assert policy.predicted == totals["prefetch_loads"] > 0
    assert totals["prefetch_hits"] > 0
    assert totals["prefetch_hits"] + totals["prefetch_wasted"] + totals["prefetch_unused"] == totals["prefetch_loads"]
    assert totals["loads"] == totals["misses"] + totals["prefetch_loads"]


def test_parse():
    assert isinstance(parse_policy("pregate"), PregateResidency)
    assert isinstance(moectl.load_policy({"type": "pregate"}), PregateResidency)


def test_recall_at_k_counts_every_predicted_layer_of_every_decoding_token():
    """recall@k over decoding steps: k chosen experts per token at every MoE layer but the first
    (30 greedy tokens: 29 decoding steps, 2 predicted layers of the tiny model, top-2)."""
    model = moectl.tiny("olmoe")
    _, _, policy = _serve(model, "pregate")
    report = policy.report()
    assert report["predicted_tokens_layers"] == 29 * 2 * 2
    assert 0.0 <= report["prediction_recall_at_k"] <= 1.0
    assert parse_policy("lru").report() == {}
