"""Token clustering by routing (EMO §5.3, Figure 5; appendix D).

The first ``first`` tokens of each document; per token the routing probabilities of every MoE
layer, concatenated; PCA keeping 95% of the variance; L2 normalisation; spherical k-means (32
clusters). Reported: the most frequent tokens of each cluster, and document purity — the
fraction of a document's tokens that fall in its majority cluster, averaged over documents;
``cluster_report`` adds each cluster's documents and majority domain (``moectl subset clusters``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moectl.errors import ConfigError
from moectl.routing import route


@dataclass
class TokenClusters:
    labels: Tensor  # [N] cluster of every token
    doc_ids: Tensor  # [N] document of every token
    token_ids: Tensor  # [N]
    components: int  # PCA dimensions kept
    purity: float
    top_tokens: dict[int, list[tuple[int, int]]]  # cluster -> [(token id, count)], most frequent first


@torch.no_grad()
def routing_features(
    model: nn.Module, tokenizer, texts: Sequence[str], first: int = 100
) -> tuple[Tensor, Tensor, Tensor]:
    """(features [N, L·E], document index [N], token id [N]) for the first ``first`` tokens of each text."""
    batch = tokenizer(list(texts), return_tensors="pt", padding=True, verbose=False)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    rows = []
    for row in range(ids.shape[0]):  # keep the first real tokens of each document (left padding)
        real = ids[row][mask[row].bool()][:first]
        rows.append(real)
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for row, real in enumerate(rows):
        ids[row, width - len(real) :], mask[row, width - len(real) :] = real, 1
    device = next(model.parameters()).device
    with route(model, [], record=True) as session:
        model(input_ids=ids.to(device), attention_mask=mask.to(device))
    valid = mask.bool()
    layers = sorted(session.trace.probs)
    features = torch.cat([session.trace.probs[i].float().cpu()[valid] for i in layers], dim=-1)
    doc_ids = torch.arange(len(rows))[:, None].expand_as(valid)[valid]
    return features, doc_ids, ids[valid]


def pca(x: Tensor, variance: float = 0.95) -> Tensor:
    """Project centred ``x`` on the fewest principal components explaining ``variance`` of it."""
    centred = x.double() - x.double().mean(0)
    _, s, vh = torch.linalg.svd(centred, full_matrices=False)
    explained = (s**2).cumsum(0) / (s**2).sum().clamp(min=1e-300)
    keep = int((explained < variance - 1e-12).sum()) + 1
    return centred @ vh[:keep].T


def spherical_kmeans(x: Tensor, k: int, seed: int = 0, iters: int = 100) -> Tensor:
    """Cluster the rows of ``x`` by cosine similarity; returns labels [N]. k-means++ initialisation."""
    x = F.normalize(x.double(), dim=-1)
    k = min(k, x.shape[0])
    generator = torch.Generator().manual_seed(seed)
    centres = [x[int(torch.randint(x.shape[0], (1,), generator=generator))]]
    for _ in range(1, k):
        distance = (1 - x @ torch.stack(centres).T).min(1).values.clamp(min=0)
        weights = distance if float(distance.sum()) > 0 else torch.ones_like(distance)
        centres.append(x[int(torch.multinomial(weights, 1, generator=generator))])
    centre = torch.stack(centres)
    labels = torch.full((x.shape[0],), -1, dtype=torch.long)
    for _ in range(iters):
        new = (x @ centre.T).argmax(1)
        if torch.equal(new, labels):
            break
        labels = new
        for c in range(k):
            members = x[labels == c]
            if len(members):
                centre[c] = F.normalize(members.sum(0), dim=-1)
    return labels


def document_purity(labels: Tensor, doc_ids: Tensor) -> float:
    """Mean over documents of the fraction of their tokens in their majority cluster."""
    fractions = []
    for doc in doc_ids.unique():
        counts = torch.bincount(labels[doc_ids == doc])
        fractions.append(float(counts.max()) / float(counts.sum()))
    return sum(fractions) / len(fractions)


def cluster_tokens(
    model: nn.Module, tokenizer, texts: Sequence[str], clusters: int = 32, first: int = 100,
    variance: float = 0.95, seed: int = 0, top: int = 10,
) -> TokenClusters:  # fmt: skip
    """EMO §5.3 token clustering of ``texts``."""
    if not texts:
        raise ConfigError("no documents to cluster")
    features, doc_ids, token_ids = routing_features(model, tokenizer, texts, first)
    projected = pca(features, variance)
    labels = spherical_kmeans(projected, clusters, seed)
    top_tokens = {int(c): Counter(token_ids[labels == c].tolist()).most_common(top) for c in labels.unique()}
    return TokenClusters(
        labels, doc_ids, token_ids, projected.shape[1], document_purity(labels, doc_ids), top_tokens
    )


def cluster_report(result: TokenClusters, doc_domains: Sequence[str], tokenizer) -> list[dict]:
    """One row per cluster: its tokens, documents, majority domain (``doc_domains[d]`` is document d's)
    with the share of the cluster's tokens from it, and its most frequent tokens (id, text, count)."""
    rows = []
    for c, frequent in sorted(result.top_tokens.items()):
        members = result.labels == c
        domains = Counter(doc_domains[int(d)] for d in result.doc_ids[members])
        major, count = domains.most_common(1)[0]
        rows.append({
            "cluster": c,
            "tokens": int(members.sum()),
            "documents": len(set(result.doc_ids[members].tolist())),
            "top_domain": major,
            "top_domain_share": count / int(members.sum()),
            "frequent_tokens": [{"id": t, "text": _decode(tokenizer, t), "count": n} for t, n in frequent],
        })  # fmt: skip
    return rows


def _decode(tokenizer, token: int) -> str:
    try:
        return tokenizer.decode([token])
    except Exception:  # a tokenizer that cannot decode a lone id: show the id
        return f"<{token}>"
