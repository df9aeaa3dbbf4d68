"""Capability gating and domain similarity (EMO §6, §5.3) on a tiny model."""

from __future__ import annotations

import pytest
import torch

import moectl
from moectl.models.load import ByteTokenizer
from moectl.reporting.similarity_plots import plot_similarity
from moectl.routing import route
from moectl.subsets.clusters import cluster_tokens, document_purity, pca, spherical_kmeans
from moectl.subsets.gating import block_mask, domain_losses, mean_loss
from moectl.subsets.similarity import document_statistics, document_vectors, domain_similarity, domain_vectors

TEXTS = {
    "math": ["1 + 1 = 2 and 2 * 3 = 6", "x^2 - 4 = 0"],
    "code": ["def f(x): return x + 1", "for i in range(3): print(i)", "import os"],
    "prose": ["It was a truth universally acknowledged."],
}


@pytest.fixture(scope="module")
def model():
    return moectl.tiny("qwen3_moe", vocab_size=ByteTokenizer.vocab_size)


@torch.no_grad()
def test_mean_loss_equals_the_models_own_loss(model):
    tokenizer = ByteTokenizer()
    text = "def f(x): return x + 1"
    ids = torch.tensor([tokenizer.encode(text)])
    assert mean_loss(model, tokenizer, [text]) == pytest.approx(float(model(ids, labels=ids).loss), rel=1e-5)
    # padding excluded: a batch's loss is the token-weighted mean of the single-text losses
    texts = TEXTS["code"]
    singles = [(mean_loss(model, tokenizer, [t]), len(tokenizer.encode(t)) - 1) for t in texts]
    expected = sum(loss * n for loss, n in singles) / sum(n for _, n in singles)
    assert mean_loss(model, tokenizer, texts) == pytest.approx(expected, rel=1e-4)


@torch.no_grad()
def test_blocking_a_subset_masks_exactly_those_experts(model):
    info = moectl.inspect(model)
    keep = {layer.index: [0, 1, 2] for layer in info.layers}
    mask = block_mask(info, keep)
    tokenizer = ByteTokenizer()
    ids = torch.tensor([tokenizer.encode("x^2 - 4 = 0")])
    with route(model, [mask], record=True) as session:
        model(ids)
    for layer in info.layers:
        assert not bool((session.trace.chosen[layer.index] < 3).any())
    before = domain_losses(model, tokenizer, TEXTS)
    after = domain_losses(model, tokenizer, TEXTS, [mask])
    assert set(after) == set(TEXTS) and all(after[d] != before[d] for d in TEXTS)
    with pytest.raises(ValueError, match="leaves 1, fewer than top-k = 2"):
        block_mask(info, {0: list(range(7))})


@torch.no_grad()
def test_domain_similarity_averages_tokens_then_documents(model, tmp_path):
    tokenizer = ByteTokenizer()
    info = moectl.inspect(model)
    vectors = domain_vectors(model, tokenizer, TEXTS, info)
    # by hand: one unpadded document at a time, mean over its tokens, then over documents
    for d, docs in enumerate(TEXTS.values()):
        for layer in info.layers:
            per_doc = []
            for doc in docs:
                with route(model, [], record=True) as session:
                    model(torch.tensor([tokenizer.encode(doc)]))
                per_doc.append(session.trace.probs[layer.index][0].mean(0))
            torch.testing.assert_close(
                vectors[layer.index][d], torch.stack(per_doc).mean(0), rtol=1e-4, atol=1e-5
            )
    similarity = domain_similarity(vectors)
    for matrix in similarity.values():
        assert matrix.shape == (3, 3)
        torch.testing.assert_close(matrix.diagonal(), torch.ones(3, dtype=torch.float64))
        torch.testing.assert_close(matrix, matrix.T)
        assert bool((matrix > 0).all()) and bool((matrix <= 1 + 1e-9).all())
    paths = plot_similarity(similarity, list(TEXTS), tmp_path)
    assert [p.name for p in paths] == [f"similarity_layer{i}.png" for i in range(info.num_moe_layers)]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_document_statistics_by_hand(model):
    # domain A: two documents on expert 0; domain B: one on expert 1, one split over experts 1 and 2
    docs = {0: [torch.tensor([[1.0, 0, 0], [1.0, 0, 0]]), torch.tensor([[0, 1.0, 0], [0, 0.5, 0.5]])]}
    stats = document_statistics(docs)[0]
    assert stats["effective_experts"] == pytest.approx((1 + 1 + 1 + 2) / 4)
    within = (1 + 0.5**0.5) / 2  # A-A pair: 1; B-B pair: cos([0,1,0],[0,.5,.5]) = 1/sqrt(2)
    assert stats["within_domain"] == pytest.approx(within)
    assert stats["across_domains"] == pytest.approx(0.0)
    per_doc = document_vectors(model, ByteTokenizer(), TEXTS)
    assert [len(d) for d in per_doc[0]] == [2, 3, 1]
    used = document_vectors(model, ByteTokenizer(), TEXTS, source="chosen")
    k = moectl.inspect(model).top_k
    for layer in used.values():
        for d in layer:  # each token puts 1/k on each of its k experts: rows sum to 1, no entry above 1/k
            torch.testing.assert_close(d.sum(-1), torch.ones(len(d)))
            assert float(d.max()) <= 1 / k + 1e-6
    with pytest.raises(ValueError, match="'probs' or 'chosen'"):
        document_vectors(model, ByteTokenizer(), TEXTS, source="gates")
    again = domain_vectors(model, ByteTokenizer(), TEXTS, documents=per_doc)
    torch.testing.assert_close(again[0], domain_vectors(model, ByteTokenizer(), TEXTS)[0])


def test_pca_keeps_the_components_explaining_95_percent():
    generator = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(6, 6, generator=generator, dtype=torch.float64))[0]
    scales = torch.tensor([10.0, 5.0, 1.0, 0.1, 0.01, 0.001], dtype=torch.float64)
    x = (torch.randn(500, 6, generator=generator, dtype=torch.float64) * scales) @ basis.T
    variance = torch.linalg.svdvals(x - x.mean(0)) ** 2
    expected = int((variance.cumsum(0) / variance.sum() < 0.95).sum()) + 1
    assert pca(x).shape == (500, expected) and expected == 2


def test_spherical_kmeans_recovers_planted_directions_and_purity_by_hand():
    generator = torch.Generator().manual_seed(1)
    directions = torch.eye(4, dtype=torch.float64)[:3]
    truth = torch.arange(3).repeat_interleave(20)
    x = (
        directions[truth] + 0.05 * torch.randn(60, 4, generator=generator, dtype=torch.float64)
    ) * torch.rand(60, 1, generator=generator, dtype=torch.float64).add(
        0.5
    )  # norms vary: only directions matter
    labels = spherical_kmeans(x, 3, seed=0)
    assert all(len(labels[truth == t].unique()) == 1 for t in range(3))
    assert len(labels.unique()) == 3
    assert torch.equal(spherical_kmeans(x, 3, seed=0), labels)
    # purity: doc 0 has tokens in clusters [0, 0, 1] (2/3), doc 1 in [2, 2] (1) -> 5/6
    assert document_purity(torch.tensor([0, 0, 1, 2, 2]), torch.tensor([0, 0, 0, 1, 1])) == pytest.approx(
        5 / 6
    )


@torch.no_grad()
def test_cluster_tokens_end_to_end(model):
    tokenizer = ByteTokenizer()
    texts = [t for docs in TEXTS.values() for t in docs]
    result = cluster_tokens(model, tokenizer, texts, clusters=4, first=8)
    n = sum(min(8, len(tokenizer.encode(t))) for t in texts)
    assert result.labels.shape == result.doc_ids.shape == result.token_ids.shape == (n,)
    first_tokens = torch.cat([torch.tensor(tokenizer.encode(t)[:8]) for t in texts])
    assert torch.equal(result.token_ids, first_tokens), "the first tokens of each document, in order"
    assert 1 <= result.components <= 8 * moectl.inspect(model).num_moe_layers
    assert len(result.labels.unique()) <= 4 and 0 < result.purity <= 1
    assert sum(c for tokens in result.top_tokens.values() for _, c in tokens) <= n
