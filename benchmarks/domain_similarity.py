"""Domain specialisation of expert use, standard vs EMO (EMO §5.3, Figure 6 and the token clusters).

For each model: per MoE layer, the cosine similarity between domains' mean routing vectors
(``moectl.subsets.similarity``; lower off-diagonal = domains use different experts), and the
token clustering of EMO §5.3 (routing probabilities of the first 100 tokens of each document,
PCA to 95% variance, spherical k-means with 32 clusters): document purity (fraction of a
document's tokens in its majority cluster) and domain purity (fraction of a cluster's tokens
from its majority domain, token-weighted). Per document: effective experts (exp entropy of the
document's mean routing distribution, from router probabilities and from the experts chosen) and
the cosine similarity of two documents' expert use within a domain vs across domains
(``subsets.similarity.document_statistics``). EMO's claim: its experts group by domain, a standard
MoE's by surface form, so EMO shows lower cross-domain similarity and purer clusters.

95% intervals: a seeded percentile bootstrap over documents (``moectl.eval.intervals``), paired —
the same resamples for every model, so ``differences`` (each model − the first) have intervals
too. A resample recomputes the domain vectors, the document-pair means and the purities from the
drawn documents. Deviations: documents are resampled from the pooled set, not within domains
(the shared helper draws one multinomial); the token clusters and each cluster's majority domain
are fitted once and held fixed (re-running k-means per resample would cost 1000 fits), so the purity
intervals cover document sampling, not clustering noise; the domain-similarity intervals are basic
(reflected) bootstrap intervals, as noise in domain means biases their cosine down (``intervals``);
documents are cut at ``--max-length`` tokens (EMO: whole documents).

    python benchmarks/domain_similarity.py --models models/moectl-small-standard models/moectl-small-emo \
        --data /work/data/corpus --max-docs 16 --max-length 256 \
        --json benchmarks/results/reference/domain_similarity.json \
        --plot benchmarks/results/reference/domain_similarity.png
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from bench_args import fail
from moectl.adapters import inspect
from moectl.data.domains import texts_by_domain
from moectl.eval.intervals import DEFAULT_SEED, bootstrap_interval
from moectl.io.atomic import write_text_atomic
from moectl.models.load import load_model
from moectl.subsets.clusters import cluster_tokens
from moectl.subsets.similarity import document_statistics, document_vectors_by_source, domain_similarity

Statistic = Callable[[np.ndarray], np.ndarray]  # bootstrap draw counts [iters, documents] -> [iters]
HEADLINE = {  # key: (label in the table and figure, the EMO direction of the effect)
    "similarity_off_diagonal": ("domain similarity, mean off-diagonal", "lower"),
    "within_domain": ("document similarity within a domain", "higher"),
    "across_domains": ("document similarity across domains", "lower"),
    "within_minus_across": ("within − across", "higher"),
    "document_purity": ("document purity (token clusters)", "higher"),
    "domain_purity": ("domain purity (token clusters)", "higher"),
    "effective_experts": ("effective experts per document", "lower"),
}


def label(spec: str) -> str:
    """A model's name for tables and figures: the folder, with its parent for a run's ``final`` /
    ``step…`` / ``checkpoint…`` folder (``runs/emo-small/final`` → ``emo-small/final``)."""
    path = Path(spec)
    if path.name in ("final", "best", "latest") or path.name.startswith(("step", "checkpoint")):
        return f"{path.parent.name}/{path.name}"
    return path.name or spec


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


# --- bootstrap statistics: each takes draw counts c [iters, N] over the N pooled documents ---------


def similarity_statistic(vectors: np.ndarray, domain: np.ndarray) -> Statistic:
    """Mean over layers of the mean off-diagonal cosine similarity between domain vectors, the domain
    vector being the (draw-weighted) mean of its documents' routing vectors. ``vectors``: [L, N, E]."""
    names = np.unique(domain)
    onehot = (domain[:, None] == names[None, :]).astype(np.float64)  # [N, D]
    off = ~np.eye(len(names), dtype=bool)

    def stat(c: np.ndarray) -> np.ndarray:
        weights = c[:, :, None] * onehot[None]  # [iters, N, D]
        sums = np.einsum("ind,lne->lide", weights, vectors, optimize=True)  # [L, iters, D, E]
        unit = sums / np.maximum(np.linalg.norm(sums, axis=-1, keepdims=True), 1e-300)
        cos = unit @ unit.transpose(0, 1, 3, 2)  # [L, iters, D, D]; the mean's scale cancels
        drawn = (c @ onehot) > 0  # a domain none of whose documents was drawn: its pairs left out
        pairs = drawn[:, :, None] & drawn[:, None, :] & off
        return ((cos * pairs).sum((-1, -2)) / pairs.sum((-1, -2))).mean(0)

    return stat


def pair_statistics(vectors: np.ndarray, domain: np.ndarray) -> dict[str, Statistic]:
    """Mean cosine similarity of two different documents' expert use within / across domains (mean
    over layers, as ``document_statistics``); a resample weighs the pair (i, j ≠ i) by c_i·c_j."""
    unit = vectors / np.maximum(np.linalg.norm(vectors, axis=-1, keepdims=True), 1e-300)
    cos = (unit @ unit.transpose(0, 2, 1)).mean(0)  # [N, N], mean over layers
    same = (domain[:, None] == domain[None, :]) & ~np.eye(len(domain), dtype=bool)
    other = domain[:, None] != domain[None, :]

    def mean_over(pairs: np.ndarray) -> Statistic:
        weighted, mask = cos * pairs, pairs.astype(np.float64)
        return lambda c: ((c @ weighted) * c).sum(1) / ((c @ mask) * c).sum(1)

    within, across = mean_over(same), mean_over(other)
    return {"within_domain": within, "across_domains": across, "within_minus_across": _minus(within, across)}


def purity_statistics(labels: np.ndarray, doc_ids: np.ndarray, domain: np.ndarray) -> dict[str, Statistic]:
    """Document purity (mean over documents of the majority-cluster share of their tokens) and domain
    purity (token-weighted share of each cluster's tokens from its majority domain) over resampled
    documents. Each cluster's majority domain is the full sample's, held fixed like the clusters: a
    majority re-taken in every resample is a max over noisy counts, biased up (on these models the
    whole percentile interval lay above the measured value)."""
    n, k = len(domain), int(labels.max()) + 1
    per_doc = np.zeros((n, k))
    np.add.at(per_doc, (doc_ids, labels), 1.0)  # tokens of document n in cluster k
    share = per_doc.max(1) / per_doc.sum(1)
    names = np.unique(domain)
    onehot = (domain[:, None] == names[None, :]).astype(np.float64)  # [N, D]
    majority = (per_doc.T @ onehot).argmax(1)  # [K] majority domain of each cluster
    in_majority = (per_doc * (onehot[:, majority] > 0)).sum(1)  # tokens in clusters led by the doc's domain
    tokens = per_doc.sum(1)
    return {
        "document_purity": lambda c: (c @ share) / c.sum(1),
        "domain_purity": lambda c: (c @ in_majority) / (c @ tokens),
    }


def effective_statistic(vectors: np.ndarray) -> Statistic:
    """Mean over documents of exp(entropy) of their routing distribution, mean over layers."""
    p = vectors / np.maximum(vectors.sum(-1, keepdims=True), 1e-12)
    per_doc = np.exp(-(p * np.log(np.maximum(p, 1e-12))).sum(-1)).mean(0)  # [N]
    return lambda c: (c @ per_doc) / c.sum(1)


def _minus(a: Statistic, b: Statistic) -> Statistic:
    return lambda c: a(c) - b(c)


def measure(spec: str, texts: dict[str, list[str]], max_length: int, clusters: int, seed: int):
    """(JSON-ready result, bootstrap statistics) of one model."""
    start = time.perf_counter()
    try:
        model, tokenizer = load_model(spec, dtype="float32")
    except (FileNotFoundError, OSError, ValueError) as err:
        fail(f"--models: {err}")
    info = inspect(model)
    domains = list(texts)
    vectors = document_vectors_by_source(model, tokenizer, texts, info, max_length)
    documents, chosen = vectors["probs"], vectors["chosen"]
    similarity = domain_similarity({i: torch.stack([d.mean(0) for d in v]) for i, v in documents.items()})
    per_doc = document_statistics(documents)
    used = document_statistics(chosen)
    off = ~torch.eye(len(domains), dtype=torch.bool)
    layers = {str(i): float(m[off].mean()) for i, m in sorted(similarity.items())}
    docs = [(name, text) for name, bucket in texts.items() for text in bucket]
    result = cluster_tokens(model, tokenizer, [t for _, t in docs], clusters, 100, 0.95, seed)
    doc_domain = [name for name, _ in docs]
    majority = Counter()
    for c in result.labels.unique().tolist():
        members = result.doc_ids[result.labels == c]
        majority[c] = Counter(doc_domain[int(d)] for d in members).most_common(1)[0][0]
    domain = np.array(doc_domain)
    probs = np.stack([torch.cat(v).double().numpy() for _, v in sorted(documents.items())])  # [L, N, E]
    picked = np.stack([torch.cat(v).double().numpy() for _, v in sorted(chosen.items())])
    stats: dict[str, Statistic] = {
        "similarity_off_diagonal": similarity_statistic(probs, domain),
        **pair_statistics(probs, domain),
        **purity_statistics(result.labels.numpy(), result.doc_ids.numpy(), domain),
        "effective_experts": effective_statistic(probs),
        **{f"chosen_{k}": v for k, v in pair_statistics(picked, domain).items()},
        "chosen_effective_experts": effective_statistic(picked),
    }
    layer_stats = {
        str(i): similarity_statistic(probs[j : j + 1], domain) for j, i in enumerate(sorted(documents))
    }
    out = {
        "model": spec,
        "label": label(spec),
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
        "seconds": round(time.perf_counter() - start, 1),
    }
    return out, stats, layer_stats


BASIC = ("similarity_off_diagonal",)  # keys whose interval is the basic (reflected) bootstrap interval


def intervals(stats: dict[str, Statistic], n: int, iters: int, seed: int, basic: Sequence[str] = ()) -> dict:
    """``{key: {value, ci95, ci_method}}``: the percentile interval, or for ``basic`` keys the basic one
    (2·value − the percentile bounds). Cosine similarity of domain means is biased down by the noise in
    the means, and a resample adds that noise again, so the percentile interval sits below the value
    (measured: 0.972 [0.966, 0.972]); the basic interval corrects that first-order bias."""
    whole = np.ones((1, n))
    out = {}
    for key, stat in stats.items():
        value = float(stat(whole)[0])
        lo, hi = bootstrap_interval(stat, n, iters, seed)
        reflect = key in basic
        out[key] = {
            "value": value,
            "ci95": [2 * value - hi, 2 * value - lo] if reflect else [lo, hi],
            "ci_method": "basic bootstrap" if reflect else "percentile bootstrap",
        }
    return out


def plot(results: list[dict], path: Path) -> None:
    """Top: each model's domain-similarity matrix at the last MoE layer (EMO: domain structure is
    clearest in later layers), one colour scale, values in the cells. Bottom: mean off-diagonal
    similarity per layer, and each headline figure's difference from the first model; 95% intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    last = max(results[0]["similarity"], key=int)
    fig = plt.figure(figsize=(max(13.0, 5.6 * n), 11))
    grid = fig.add_gridspec(2, 2 * n, height_ratios=[1.1, 1.0])
    matrices = [np.array(r["similarity"][last]) for r in results]
    low = float(min(m[~np.eye(len(m), dtype=bool)].min() for m in matrices))
    colours = plt.get_cmap("tab10")
    for i, (res, matrix) in enumerate(zip(results, matrices, strict=True)):
        ax = fig.add_subplot(grid[0, 2 * i : 2 * i + 2])
        image = ax.imshow(matrix, vmin=low, vmax=1.0, cmap="viridis")
        ax.set_xticks(range(len(res["domains"])), res["domains"], rotation=60, ha="right")
        ax.set_yticks(range(len(res["domains"])), res["domains"])
        for (r, c), value in np.ndenumerate(matrix):
            ax.text(c, r, f"{value:.2f}", ha="center", va="center", fontsize=7,
                    color="w" if value < low + 0.6 * (1 - low) else "k")  # fmt: skip
        h = res["similarity_per_layer_ci95"][last]
        ax.set_title(f"{res['label']}: MoE layer {last} (last)\nmean off-diagonal {h['value']:.3f} "
                     f"[{h['ci95'][0]:.3f}, {h['ci95'][1]:.3f}]", fontsize=10, color=colours(i))  # fmt: skip
        fig.colorbar(image, ax=ax, fraction=0.046, label="cosine similarity of domain routing vectors")
    ax = fig.add_subplot(grid[1, :n])
    for i, res in enumerate(results):
        layers = res["similarity_per_layer_ci95"]
        x = np.arange(len(layers))
        lo, hi = ([v["ci95"][j] for v in layers.values()] for j in (0, 1))
        h = res["headline"]["similarity_off_diagonal"]
        ax.plot(
            x,
            [v["value"] for v in layers.values()],
            marker="o",
            color=colours(i),
            label=f"{res['label']}: mean over layers {h['value']:.3f} [{h['ci95'][0]:.3f}, {h['ci95'][1]:.3f}]",
        )
        ax.fill_between(x, lo, hi, color=colours(i), alpha=0.2, lw=0)  # fmt: skip
        ax.set_xticks(x, list(layers))
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("mean off-diagonal domain similarity")
    ax.set_title("domain similarity per layer (EMO: lower = domains use different experts)\nshaded: 95% basic "
                 "bootstrap interval (corrects the downward bias)", fontsize=10)  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    ax = fig.add_subplot(grid[1, n:])
    keys = [k for k in HEADLINE if k != "effective_experts"]
    first = results[0]
    names = []
    for k in keys:
        values = " vs ".join(f"{r['headline'][k]['value']:.3f}" for r in results)
        names.append(f"{HEADLINE[k][0]} (EMO: {HEADLINE[k][1]})\n{values}")
    for i, res in enumerate(results[1:], start=1):
        d = res["differences_vs_first"]
        y = np.arange(len(keys)) + (i - n / 2) * 0.15
        x = np.array([d[k]["value"] for k in keys])
        err = np.array([[x[j] - d[k]["ci95"][0], d[k]["ci95"][1] - x[j]] for j, k in enumerate(keys)]).T
        ax.errorbar(x, y, xerr=err.clip(min=0), fmt="o", color=colours(i), capsize=3,
                    label=f"{res['label']} − {first['label']}")  # fmt: skip
    ax.axvline(0, color="grey", lw=0.8)
    ax.set_yticks(range(len(keys)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("difference, 95% paired bootstrap interval over documents")
    ax.set_title(f"headline figures ({' vs '.join(r['label'] for r in results)})", fontsize=10)
    ax.grid(alpha=0.3, axis="x")
    if n > 1:
        ax.legend(fontsize=8, loc="upper right")
    docs = sum(first["documents"].values())
    fig.suptitle(f"Domain similarity of expert use (EMO Fig. 6 + §5.3 clusters): {len(first['domains'])} domains, "
                 f"{docs} validation documents", fontsize=11)  # fmt: skip
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replot(source: Path, path: Path | None) -> None:
    """Draw the figure of an earlier ``--json`` file."""
    if path is None:
        fail("--replot needs --plot PNG (the figure to draw)")
    try:
        results = json.loads(source.read_text())["results"]
        if not results or not all(
            {"similarity", "headline", "similarity_per_layer_ci95"} <= set(r) for r in results
        ):
            raise ValueError("a result lacks similarity / headline / similarity_per_layer_ci95")
    except (OSError, ValueError, KeyError, TypeError) as err:
        fail(f"--replot {source}: not a domain_similarity --json file with intervals ({err})")
    plot(results, path)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["tiny:qwen2_moe"])
    parser.add_argument("--data", type=Path, help="corpus folder or DOMAIN.jsonl folder (required)")
    parser.add_argument("--max-docs", type=int, default=64, help="validation documents per domain")
    parser.add_argument("--max-length", type=int, default=512, help="tokens per document")
    parser.add_argument("--clusters", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="k-means seed")
    parser.add_argument("--iters", type=int, default=1000, help="bootstrap resamples")
    parser.add_argument("--ci-seed", type=int, default=DEFAULT_SEED, help="bootstrap seed")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument(
        "--replot", type=Path, help="only redraw --plot from this earlier --json (no model run)"
    )
    args = parser.parse_args(argv)
    if args.plot is not None and args.plot.suffix.lower() != ".png":
        fail(f"--plot must name a .png file, got {args.plot}")
    if args.replot is not None:
        replot(args.replot, args.plot)
        return
    if args.data is None:
        fail("--data is required: a corpus folder (validation split) or a folder of DOMAIN.jsonl files")
    if args.max_docs < 2 or args.max_length < 2:
        fail(f"--max-docs and --max-length must be at least 2, got {args.max_docs} and {args.max_length}")
    torch.set_num_threads(args.threads)
    try:
        texts = texts_by_domain(args.data, "validation", args.max_docs, min_domains=2)
    except (FileNotFoundError, ValueError) as err:
        fail(f"--data: {err}")
    n = sum(len(t) for t in texts.values())
    results, stats = [], []
    for spec in args.models:
        res, stat, layer_stats = measure(spec, texts, args.max_length, args.clusters, args.seed)
        res["headline"] = intervals(stat, n, args.iters, args.ci_seed, BASIC)
        res["similarity_per_layer_ci95"] = intervals(
            layer_stats, n, args.iters, args.ci_seed, list(layer_stats)
        )
        results.append(res)
        stats.append(stat)
    for res, stat in zip(results[1:], stats[1:], strict=True):  # paired: the same resamples
        res["differences_vs_first"] = intervals({k: _minus(stat[k], stats[0][k]) for k in stat}, n,
                                                args.iters, args.ci_seed, BASIC)  # fmt: skip
    print(f"{n} validation documents in {len(texts)} domains; 95% bootstrap intervals over documents")
    print(f"{'':44s}" + "".join(f"{r['label']:>30s}" for r in results)
          + ("".join(f"{r['label'] + ' − first':>36s}" for r in results[1:])))  # fmt: skip
    for key in [*HEADLINE, "chosen_within_domain", "chosen_across_domains", "chosen_effective_experts"]:
        name = HEADLINE[key][0] if key in HEADLINE else key.replace("_", " ")
        cells = [r["headline"][key] for r in results] + [r["differences_vs_first"][key] for r in results[1:]]
        widths = [30] * len(results) + [36] * (len(results) - 1)
        print(f"{name:44s}" + "".join(f"{c['value']:.3f} [{c['ci95'][0]:.3f}, {c['ci95'][1]:.3f}]".rjust(w)
                                      for c, w in zip(cells, widths, strict=True)))  # fmt: skip
    for res in results:
        per_layer = " ".join(f"{v:.3f}" for v in res["similarity_mean_off_diagonal"].values())
        print(f"{res['label']}: mean off-diagonal similarity per layer {per_layer}")
    if args.json:
        payload = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "intervals": {"confidence": 0.95, "method": "percentile bootstrap over documents (pooled, paired "
                          "across models; clusters fixed)", "iters": args.iters, "seed": args.ci_seed},
            "results": results,
        }  # fmt: skip
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(args.json, json.dumps(payload, indent=1))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
