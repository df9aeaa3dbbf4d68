"""Effective experts per document: E for a uniform router, top-k for fixed routing, and the same
figure as ``subsets.similarity.document_statistics``."""

from __future__ import annotations

import math

import pytest
import torch

import moectl
from moectl.metrics.effective_experts import effective_experts, effective_number, measure, summarise
from moectl.models.load import load_model
from moectl.routing import ExpertMask, route
from moectl.subsets.calibrate import tokenize
from moectl.subsets.similarity import document_statistics, document_vectors

TEXTS = ["the cat sat on the mat", "def f(x): return x + 1", "Il était une fois un roi", "1 + 2 = 3"]


def test_effective_number_of_known_distributions():
    p = torch.tensor([[1.0, 0, 0, 0], [0.5, 0.5, 0, 0], [1, 1, 1, 1], [2.0, 1, 1, 0]])
    expected = [1.0, 2.0, 4.0, math.exp(-(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25)))]
    assert torch.allclose(effective_number(p), torch.tensor(expected, dtype=torch.float64))


def test_uniform_router_uses_all_experts_fixed_routing_uses_top_k():
    model, tok = load_model("tiny:qwen2_moe")
    info = moectl.inspect(model)
    e, k = info.num_experts, info.top_k
    with torch.no_grad():
        for layer in info.layers:
            layer.router.weight.zero_()  # every token: p uniform over the E experts
    batch = tokenize(tok, TEXTS)
    result = measure(model, [batch], info)
    for values in result["probs"].values():
        assert torch.allclose(values, torch.full_like(values, float(e)))
    # every token of every document routed to the same k experts: exactly k effective experts
    keep = ExpertMask.from_lists(info, {layer.index: range(k) for layer in info.layers})
    with torch.no_grad(), route(model, keep, record=True, info=info) as session:
        model(**batch)
    for values in effective_experts(session.trace, "chosen").values():
        assert torch.allclose(values, torch.full_like(values, float(k)))
    table = summarise(result["probs"])
    assert set(table) == {layer.index for layer in info.layers}
    assert all(row["documents"] == len(TEXTS) and row["min"] == pytest.approx(e) for row in table.values())


def test_same_figure_as_document_statistics_and_between_k_and_e():
    model, tok = load_model("tiny:olmoe")
    info = moectl.inspect(model)
    # two batches of two documents: the padding of each batch is excluded
    ours = measure(model, [tokenize(tok, TEXTS[:2], 64), tokenize(tok, TEXTS[2:], 64)], info)
    for source, low in (("probs", 1.0), ("chosen", float(info.top_k))):
        theirs = document_statistics(document_vectors(model, tok, {"all": TEXTS}, info, 64, source=source))
        for layer, values in ours[source].items():
            assert values.shape == (len(TEXTS),)
            assert float(values.mean()) == pytest.approx(theirs[layer]["effective_experts"], rel=1e-5)
            assert bool((values >= low - 1e-9).all() and (values <= info.num_experts + 1e-9).all())
