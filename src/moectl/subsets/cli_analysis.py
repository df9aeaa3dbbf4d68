"""``moectl subset gate`` (EMO §6, capability gating) and ``moectl subset clusters`` (EMO §5.3).

    moectl subset gate MODEL --subset math.subset.json --data domains/ --json gate.json
    moectl subset clusters MODEL --data domains/ --out clusters/

``--data`` is a directory of DOMAIN.jsonl files or a moectl corpus folder (its validation split,
by ``domain``), as for ``moectl modularity``; ``clusters`` also takes a single JSONL file.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from moectl.cli_common import DeviceOpt, DtypeOpt, JsonOpt, ModelArg, console, fail, write_json
from moectl.subsets.cli import _ERRORS, subset_app, texts_by_domain

DataOpt = Annotated[
    Path,
    typer.Option(
        "--data", help="Directory of DOMAIN.jsonl files ('text' per line), or a moectl corpus folder."
    ),
]
MaxDocsOpt = Annotated[int | None, typer.Option("--max-docs", help="Documents per domain.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of a tiny model's weights (and k-means).")]


@subset_app.command("gate")
def gate_cmd(
    model: ModelArg,
    subset: Annotated[Path, typer.Option("--subset", help="Subset file whose experts are blocked.")],
    data: DataOpt,
    domain: Annotated[
        str | None,
        typer.Option("--domain", help="The subset's own domain (default: its calibration file's name)."),
    ] = None,
    max_docs: MaxDocsOpt = None,
    max_length: Annotated[
        int, typer.Option("--max-length", help="Tokens per document (the last ones).")
    ] = 512,
    seed: SeedOpt = 0,
    json_path: JsonOpt = None,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "auto",
) -> None:
    """Per-domain loss with and without the subset's experts blocked (EMO §6, fine-grained control)."""
    from moectl.adapters import inspect
    from moectl.models.load import load_model
    from moectl.subsets.files import load_subset
    from moectl.subsets.gating import block_mask, domain_losses

    try:
        texts = texts_by_domain(data, max_docs, min_domains=1)
        lm, tokenizer = load_model(model, dtype=dtype, device=device, seed=seed)
        info = inspect(lm)
        chosen = load_subset(subset, info)
        mask = block_mask(info, chosen.keep)
        full = domain_losses(lm, tokenizer, texts, max_length=max_length)
        blocked = domain_losses(lm, tokenizer, texts, [mask], max_length=max_length)
    except _ERRORS as err:
        fail(err)
    own = domain or Path(str(chosen.calibration.get("data", ""))).stem
    own = own if own in texts else None
    rows = {
        name: {"full": full[name], "blocked": blocked[name], "increase": blocked[name] - full[name],
               "relative": blocked[name] / full[name] - 1}
        for name in texts
    }  # fmt: skip
    kept = len(next(iter(chosen.keep.values())))
    table = Table(title=f"blocking {subset.name}: {kept} of {info.num_experts} experts per MoE layer")
    for column in ("domain", "loss", "blocked", "increase", "relative"):
        table.add_column(column, justify="right")
    for name, row in rows.items():
        label = f"[bold]{name} *[/bold]" if name == own else name
        table.add_row(label, f"{row['full']:.4f}", f"{row['blocked']:.4f}", f"{row['increase']:+.4f}",
                      f"{row['relative']:+.1%}")  # fmt: skip
    console.print(table)
    result = {"model": model, "subset": str(subset), "blocked_experts": kept, "domain": own, "domains": rows}
    others = [row["increase"] for name, row in rows.items() if name != own]
    if own is not None and others:
        result["selectivity"] = rows[own]["increase"] - sum(others) / len(others)
        console.print(
            f"{own} (*) loses {rows[own]['increase']:+.4f}; the other domains {sum(others) / len(others):+.4f} "
            f"on average; selectivity {result['selectivity']:+.4f}"
        )
    write_json(json_path, result)


@subset_app.command("clusters")
def clusters_cmd(
    model: ModelArg,
    data: Annotated[
        Path,
        typer.Option("--data", help="A JSONL file, a directory of DOMAIN.jsonl files or a corpus folder."),
    ],
    out: Annotated[Path, typer.Option("--out", help="Directory for clusters.json.")],
    clusters: Annotated[int, typer.Option("--clusters", help="k of spherical k-means (EMO: 32).")] = 32,
    first: Annotated[int, typer.Option("--first", help="Tokens per document (the first; EMO: 100).")] = 100,
    variance: Annotated[float, typer.Option("--variance", help="PCA variance kept (EMO: 0.95).")] = 0.95,
    top: Annotated[int, typer.Option("--top", help="Most frequent tokens listed per cluster.")] = 10,
    max_docs: MaxDocsOpt = None,
    seed: SeedOpt = 0,
    json_path: JsonOpt = None,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "auto",
) -> None:
    """Cluster tokens by their routing (EMO §5.3, appendix D): frequent tokens, document purity."""
    from moectl.models.load import load_model
    from moectl.subsets.clusters import cluster_tokens

    try:
        if not 0 < variance <= 1:
            raise ValueError(f"--variance must lie in (0, 1], got {variance}")
        if clusters < 1 or first < 1:
            raise ValueError("--clusters and --first must be at least 1")
        texts = texts_by_domain(data, max_docs, min_domains=1)
        docs = [(name, text) for name, bucket in texts.items() for text in bucket]
        lm, tokenizer = load_model(model, dtype=dtype, device=device, seed=seed)
        result = cluster_tokens(lm, tokenizer, [t for _, t in docs], clusters, first, variance, seed, top)
    except _ERRORS as err:
        fail(err)
    doc_domain = [name for name, _ in docs]
    report = []
    for c, frequent in sorted(result.top_tokens.items()):
        members = result.labels == c
        domains = Counter(doc_domain[int(d)] for d in result.doc_ids[members])
        major, count = domains.most_common(1)[0]
        report.append({
            "cluster": c,
            "tokens": int(members.sum()),
            "documents": len(set(result.doc_ids[members].tolist())),
            "top_domain": major,
            "top_domain_share": count / int(members.sum()),
            "frequent_tokens": [{"id": t, "text": _decode(tokenizer, t), "count": n} for t, n in frequent],
        })  # fmt: skip
    table = Table(
        title=f"{len(report)} token clusters ({result.components} PCA dims); purity {result.purity:.3f}"
    )
    for column in ("cluster", "tokens", "docs", "top domain", "frequent tokens"):
        table.add_column(column, justify="right" if column in ("cluster", "tokens", "docs") else "left")
    for row in report:
        words = " ".join(repr(t["text"])[1:-1] or "∅" for t in row["frequent_tokens"][:8])
        table.add_row(str(row["cluster"]), str(row["tokens"]), str(row["documents"]),
                      f"{row['top_domain']} {row['top_domain_share']:.0%}", words)  # fmt: skip
    console.print(table)
    data_out = {
        "model": model, "data": str(data), "documents": {n: len(b) for n, b in texts.items()},
        "clusters": clusters, "first": first, "variance": variance, "components": result.components,
        "purity": result.purity, "report": report,
    }  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "clusters.json").write_text(json.dumps(data_out, indent=2) + "\n")
    console.print(f"[dim]wrote {out}/clusters.json[/dim]")
    write_json(json_path, data_out)


def _decode(tokenizer, token: int) -> str:
    try:
        return tokenizer.decode([token])
    except Exception:  # a tokenizer that cannot decode a lone id: show the id
        return f"<{token}>"
