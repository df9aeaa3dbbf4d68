"""Effective experts per document, per MoE layer, for one or more models (issue 14.2; EMO §5.3).

Per document and MoE layer: exp of the entropy of the document's mean routing distribution
(``moectl.metrics.effective_experts``), from the router's probabilities and from the experts
chosen (1/k each per token). E for a router that has not learned to route, k when a document
keeps to k experts. The table gives, per layer and model, the mean over documents with its 95%
interval (seeded bootstrap over documents, ``moectl.eval.intervals.mean_interval``); the PNG
draws the same per-layer means with their intervals.

Documents: up to ``--max-docs`` per domain of the corpus split (``moectl.data.domains``), each
cut to its last ``--max-length`` tokens, ``--batch-size`` per forward pass.

    python benchmarks/effective_experts.py --models models/moectl-small-standard models/moectl-small-emo \
        --data data/corpus --max-docs 32 --json benchmarks/results/effective_experts.json \
        --plot benchmarks/results/effective_experts.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from moectl.adapters import inspect
from moectl.data.domains import texts_by_domain
from moectl.eval.intervals import mean_interval
from moectl.metrics.effective_experts import measure, report
from moectl.models.load import load_model
from moectl.subsets.calibrate import tokenize


def run(spec: str, texts: list[str], max_length: int, batch_size: int) -> dict:
    model, tokenizer = load_model(spec)
    info = inspect(model)
    batches = (
        tokenize(tokenizer, texts[i : i + batch_size], max_length) for i in range(0, len(texts), batch_size)
    )
    return report(measure(model, batches, info), info, spec, lambda v: mean_interval(v.numpy()))


def plot(results: list[dict], path: Path, documents: int, goal: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, res in enumerate(results):
        name = Path(res["model"]).name or res["model"]
        layers = sorted(int(k) for k in res["layers"])
        for source, style, marker in (("probs", "-", "o"), ("chosen", "--", "s")):
            rows = [res["layers"][str(layer)][source] for layer in layers]
            mean = [r["mean"] for r in rows]
            low = [r["ci95"][0] for r in rows]
            high = [r["ci95"][1] for r in rows]
            label = f"{name}: router probabilities" if source == "probs" else f"{name}: chosen experts"
            ax.plot(layers, mean, style, marker=marker, color=colours[i % len(colours)], label=label)
            ax.fill_between(layers, low, high, color=colours[i % len(colours)], alpha=0.15, linewidth=0)
    e, k = results[0]["num_experts"], results[0]["top_k"]
    lines = [(e, f"E = {e}\n(uniform)", "0.4"), (k, f"top-k = {k}", "0.4")]
    lines += [] if goal is None else [(goal, f"goal <= {goal:g}", "tab:red")]
    for y, text, colour in lines:  # reference lines, labelled in the right margin
        ax.axhline(y, color=colour, linestyle=":" if colour == "0.4" else "-.", linewidth=1)
        ax.text(1.01, y, text, transform=ax.get_yaxis_transform(), va="center", fontsize=8, color=colour)
    layers = sorted(int(k) for k in results[0]["layers"])
    ax.set_xticks(
        layers, [f"{m}\n(decoder {d})" for m, d in zip(layers, results[0]["moe_layers"], strict=True)]
    )
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("effective experts per document\nexp H(mean routing distribution)")
    ax.set_ylim(0, e * 1.08)
    ax.set_title(f"Effective experts per document ({documents} documents; shading: 95% interval of the mean)",
                 fontsize=10)  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=min(2, len(results) * 2))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["tiny:qwen2_moe"])
    parser.add_argument("--data", type=Path, required=True, help="corpus folder (or JSONL) with a split")
    parser.add_argument("--split", default="validation")
    parser.add_argument("--max-docs", type=int, default=32, help="documents per domain")
    parser.add_argument("--max-length", type=int, default=512, help="tokens per document (its last ones)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--goal", type=float, default=None, help="draw a goal line (issue 14: 24 of 32)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    groups = texts_by_domain(args.data, args.split, args.max_docs)
    texts = [t for bucket in groups.values() for t in bucket]
    results = [run(m, texts, args.max_length, args.batch_size) for m in args.models]
    names = [Path(r["model"]).name or r["model"] for r in results]
    print(f"effective experts per document ({len(texts)} documents, {len(groups)} domains: "
          f"{', '.join(f'{d} {len(b)}' for d, b in groups.items())}); mean [95% interval]")  # fmt: skip
    width = 21  # "mean [low, high]"
    print(f"{'':>9s}" + "".join(f" | {n[: 2 * width + 1]:^{2 * width + 1}s}" for n in names))
    print(
        f"{'MoE layer':>9s}"
        + " | ".join([""] + [f"{'router probs':>{width}s} {'chosen experts':>{width}s}"] * len(names))
    )

    def cell(v: dict) -> str:
        return f"{v['mean']:6.2f} [{v['ci95'][0]:5.2f}, {v['ci95'][1]:5.2f}]"

    for layer in sorted(results[0]["layers"], key=int):
        rows = [res["layers"][layer] for res in results]
        print(
            f"{layer:>9s}"
            + "".join(f" | {cell(r['probs']):>{width}s} {cell(r['chosen']):>{width}s}" for r in rows)
        )
    means = [r["mean_over_layers"] for r in results]
    print(f"{'mean':>9s}" + "".join(f" | {m['probs']:>{width}.2f} {m['chosen']:>{width}.2f}" for m in means))
    print(f"(E = {results[0]['num_experts']}, top-k = {results[0]['top_k']})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "documents": {d: len(b) for d, b in groups.items()},
            "results": results,
        }
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
    if args.plot:
        plot(results, args.plot, len(texts), args.goal)


if __name__ == "__main__":
    main()
