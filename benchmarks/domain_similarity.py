"""Domain specialisation of expert use, standard vs EMO (EMO §5.3, Figure 6 and the token clusters).

For each model: per MoE layer, the cosine similarity between domains' mean routing vectors
(``moectl.subsets.similarity``; lower off-diagonal = domains use different experts), and the
token clustering of EMO §5.3 (routing probabilities of the first 100 tokens of each document,
PCA to 95% variance, spherical k-means with 32 clusters): document purity (fraction of a
document's tokens in its majority cluster) and domain purity (fraction of a cluster's tokens
from its majority domain, token-weighted). Per document: effective experts (exp entropy of the
document's mean routing distribution, from router probabilities and from the experts chosen) and the cosine similarity of two documents' expert use
within a domain vs across domains (``subsets.similarity.document_statistics``). EMO's claim: its experts group by domain, a standard
MoE's by surface form, so EMO shows lower cross-domain similarity and purer clusters.

    python benchmarks/domain_similarity.py --models models/moectl-small-standard models/moectl-small-emo \
        --data data/corpus --max-docs 64 --json benchmarks/results/domain_similarity.json \
        --plot benchmarks/results/domain_similarity.png
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch

from moectl.adapters import inspect
from moectl.data.domains import texts_by_domain
from moectl.models.load import load_model
from moectl.subsets.clusters import cluster_tokens
from moectl.subsets.similarity import document_statistics, document_vectors, domain_similarity, domain_vectors


def domain_purity(labels: torch.Tensor, doc_ids: torch.Tensor, doc_domain: list[str]) -> float:
    """Token-weighted share of each cluster's tokens that come from its majority domain."""
    names = sorted(set(doc_domain))
    domain_of_doc = torch.tensor([names.index(d) for d in doc_domain])
    token_domain = domain_of_doc[doc_ids]
    counts = torch.zeros(int(labels.max()) + 1, len(names))
    counts.index_put_((labels, token_domain), torch.ones_like(labels, dtype=torch.float), accumulate=True)
    return float(counts.max(1).values.sum() / counts.sum())


def _layer_mean(stats: dict[int, dict[str, float]]) -> dict[str, float]:
    keys = ("effective_experts", "within_domain", "across_domains")
    return {key: sum(v[key] for v in stats.values()) / len(stats) for key in keys}


def measure(spec: str, data: Path, max_docs: int, max_length: int, clusters: int, seed: int) -> dict:
    model, tokenizer = load_model(spec)
    info = inspect(model)
    texts = texts_by_domain(data, "validation", max_docs, min_domains=2)
    domains = list(texts)
    documents = document_vectors(model, tokenizer, texts, info, max_length)
    similarity = domain_similarity(domain_vectors(model, tokenizer, texts, documents=documents))
    per_doc = document_statistics(documents)
    used = document_statistics(document_vectors(model, tokenizer, texts, info, max_length, source="chosen"))
    off = ~torch.eye(len(domains), dtype=torch.bool)
    layers = {str(i): float(m[off].mean()) for i, m in sorted(similarity.items())}
    docs = [(name, text) for name, bucket in texts.items() for text in bucket]
    result = cluster_tokens(model, tokenizer, [t for _, t in docs], clusters, 100, 0.95, seed)
    doc_domain = [name for name, _ in docs]
    majority = Counter()
    for c in result.labels.unique().tolist():
        members = result.doc_ids[result.labels == c]
        majority[c] = Counter(doc_domain[int(d)] for d in members).most_common(1)[0][0]
    return {
        "model": spec,
        "domains": domains,
        "documents": {n: len(b) for n, b in texts.items()},
        "similarity_mean_off_diagonal": layers,
        "similarity_mean_all_layers": sum(layers.values()) / len(layers),
        "documents_per_layer": {str(i): v for i, v in per_doc.items()},
        "documents_mean_all_layers": _layer_mean(per_doc),
        "chosen_documents_per_layer": {str(i): v for i, v in used.items()},
        "chosen_documents_mean_all_layers": _layer_mean(used),
        "similarity": {str(i): m.tolist() for i, m in similarity.items()},
        "clusters": {
            "k": clusters,
            "pca_components": result.components,
            "document_purity": result.purity,
            "domain_purity": domain_purity(result.labels, result.doc_ids, doc_domain),
            "clusters_led_by_each_domain": dict(Counter(majority.values())),
        },
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.2 * len(results), 4.6))
    for ax, res in zip(list(axes) if len(results) > 1 else [axes], results, strict=True):
        mean = torch.tensor(list(res["similarity"].values())).mean(0)
        image = ax.imshow(mean.numpy(), vmin=0.5, vmax=1.0, cmap="viridis")
        ax.set_xticks(range(len(res["domains"])), res["domains"], rotation=60)
        ax.set_yticks(range(len(res["domains"])), res["domains"])
        ax.set_title(f"{Path(res['model']).name}\nmean off-diag {res['similarity_mean_all_layers']:.3f}")
        fig.colorbar(image, ax=ax, fraction=0.046)
    fig.suptitle("Domain similarity of expert use, mean over MoE layers (EMO Fig. 6)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny:qwen2_moe"])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--max-docs", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--clusters", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    results = [
        measure(m, args.data, args.max_docs, args.max_length, args.clusters, args.seed) for m in args.models
    ]
    print(f"{'model':40s} {'sim (mean off-diag, per layer)':48s} all   doc-pur dom-pur "
          "| probs: eff-exp doc-in doc-x | chosen: eff-exp doc-in doc-x")
    for res in results:
        per_layer = " ".join(f"{v:.3f}" for v in res["similarity_mean_off_diagonal"].values())
        c, d, u = res["clusters"], res["documents_mean_all_layers"], res["chosen_documents_mean_all_layers"]
        print(
            f"{res['model']:40s} {per_layer:48s} {res['similarity_mean_all_layers']:.3f} "
            f"{c['document_purity']:.3f}   {c['domain_purity']:.3f}   | {d['effective_experts']:6.2f} "
            f"{d['within_domain']:.3f} {d['across_domains']:.3f} | {u['effective_experts']:6.2f} "
            f"{u['within_domain']:.3f} {u['across_domains']:.3f}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
