"""``moectl subset ...``: per-domain expert subsets from the command line (mounted as ``subset``).

    moectl subset select MODEL --data math_val.jsonl --keep 8 --method router --out math.subset.json
    moectl subset export MODEL --subset math.subset.json --out math-8/
    moectl subset finetune math-8/ --data math_train.jsonl --out math-8-ft/        # cli_train.py
    moectl subset merge MODEL --subset math.subset.json --experts math-8-ft/ --out merged/
    moectl subset gate MODEL --subset math.subset.json --data domains/ --json gate.json  # cli_analysis.py
    moectl subset clusters MODEL --data domains/ --out clusters/
    moectl modularity MODEL --data domains/ --out report/     # ``modularity_cmd``, mounted top-level

MODEL is ``tiny:FAMILY`` (an offline random model), a checkpoint directory or a hub id. ``--data``
is JSONL with a ``text`` field per line. Each verb prints a rich table and writes its results
with ``--json``.
"""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.table import Table

from moectl.cli_common import DeviceOpt, DtypeOpt, JsonOpt, ModelArg, console, fail, write_json
from moectl.data.jsonl import iter_jsonl_rows

subset_app = typer.Typer(
    help="Per-domain expert subsets: select, export, finetune, merge, gate, clusters (EMO §4.2, §5.2, §5.3, §6, C).",
    no_args_is_help=True,
)
_ERRORS = (ValueError, OSError, KeyError)


def read_texts(path: Path, limit: int | None = None) -> list[str]:
    """The ``text`` field of every JSONL line, at most ``limit``; blank lines and empty texts skipped."""
    rows = iter_jsonl_rows(path, "text")
    texts = list(islice((row["text"] for _, row in rows if row["text"].strip()), limit))
    if not texts:
        raise ValueError(f"{path}: no documents")
    return texts


@subset_app.command("select")
def select_cmd(
    model: ModelArg,
    data: Annotated[Path, typer.Option("--data", help="Calibration JSONL with a 'text' field per line.")],
    keep: Annotated[int, typer.Option("--keep", help="Experts kept in every MoE layer.")],
    out: Annotated[Path, typer.Option("--out", help="Subset file to write (JSON).")],
    method: Annotated[
        str, typer.Option("--method", help="router | frequency | easy-ep | reconstruction | wanda | random")
    ] = "router",
    layerwise: Annotated[
        bool, typer.Option("--layerwise", help="Prune layer l before measuring layer l+1.")
    ] = False,
    max_docs: Annotated[int | None, typer.Option("--max-docs", help="Use the first N documents.")] = None,
    max_length: Annotated[
        int, typer.Option("--max-length", help="Tokens per document (the last ones).")
    ] = 512,
    seed: Annotated[int, typer.Option("--seed", help="Seed (random method; tiny model weights).")] = 0,
    json_path: JsonOpt = None,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "auto",
) -> None:
    """Select the experts to keep per MoE layer from a small calibration set."""
    from moectl.adapters import inspect
    from moectl.models.load import load_model
    from moectl.subsets.calibrate import tokenize
    from moectl.subsets.files import save_subset
    from moectl.subsets.select import method_name, select_subset

    try:
        method = method_name(method)
        texts = read_texts(data, max_docs)
        lm, tokenizer = load_model(model, dtype=dtype, device=device, seed=seed)
        info = inspect(lm)
        batch = tokenize(tokenizer, texts, max_length)
        kept = select_subset(
            lm, batch["input_ids"], keep, method, batch["attention_mask"], layerwise, seed, info
        )
    except _ERRORS as err:
        fail(err)
    calibration = {
        "data": str(data),
        "documents": len(texts),
        "tokens": int(batch["attention_mask"].sum()),
        "max_length": max_length,
        "layerwise": layerwise,
        "seed": seed,
    }
    save_subset(out, kept, model=model, method=method, calibration=calibration)
    table = Table(title=f"{method} subset: {keep} of {info.num_experts} experts per MoE layer")
    for column in ("MoE layer", "decoder layer", "kept experts"):
        table.add_column(column)
    for layer in info.layers:
        table.add_row(str(layer.index), str(layer.layer_idx), " ".join(map(str, kept[layer.index])))
    console.print(table)
    console.print(f"[dim]wrote {out}[/dim]")
    result = {"model": model, "method": method, "keep": {str(k): v for k, v in kept.items()}}
    write_json(json_path, {**result, "calibration": calibration, "out": str(out)})


@subset_app.command("export")
def export_cmd(
    model: ModelArg,
    subset: Annotated[Path, typer.Option("--subset", help="Subset file from `moectl subset select`.")],
    out: Annotated[Path, typer.Option("--out", help="Directory for the smaller checkpoint.")],
    seed: Annotated[int, typer.Option("--seed", help="Seed of a tiny model's weights.")] = 0,
    json_path: JsonOpt = None,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "auto",
) -> None:
    """Slice the unselected experts out and save a checkpoint plain transformers loads."""
    from moectl.adapters import inspect
    from moectl.models.load import load_model
    from moectl.subsets.export import export_subset
    from moectl.subsets.files import load_subset

    try:
        try:
            lm, tokenizer = load_model(model, dtype=dtype, device=device, seed=seed)
        except (OSError, ValueError):  # a checkpoint without a (loadable) tokenizer: weights only
            lm, tokenizer = load_model(model, dtype=dtype, device=device, seed=seed, with_tokenizer=False)
            console.print(f"[yellow]note:[/yellow] no tokenizer loads from {model}; exporting weights only")
        info = inspect(lm)
        chosen = load_subset(subset, info)
        if chosen.model not in (None, model):
            console.print(
                f"[yellow]warning:[/yellow] {subset} was selected on {chosen.model}, exporting {model}"
            )
        source = Path(model) if Path(model).is_dir() else None
        metadata = {"model": model, "subset_file": str(subset), "method": chosen.method,
                    "calibration": chosen.calibration}  # fmt: skip
        report = export_subset(lm, chosen.keep, out, tokenizer, info, metadata, source, in_place=True)
    except _ERRORS as err:
        fail(err)
    table = Table(title=f"exported {out}: {report['experts_after']} experts per MoE layer")
    for column in ("", "before", "after", "after / before"):
        table.add_column(column, justify="right")
    before, after = report["before"], report["after"]
    for key, label in (
        ("parameters", "parameters"),
        ("tensor_bytes", "tensor bytes"),
        ("disk_bytes", "bytes on disk"),
    ):
        if key in before:
            table.add_row(label, f"{before[key]:,}", f"{after[key]:,}", f"{after[key] / before[key]:.3f}")
        else:
            table.add_row(label, "-", f"{after[key]:,}", "-")
    console.print(table)
    write_json(json_path, report)


def modularity_cmd(
    model: ModelArg,
    data: Annotated[
        Path,
        typer.Option(
            "--data", help="Directory of DOMAIN.jsonl files ('text' per line), or a moectl corpus folder."
        ),
    ],
    out: Annotated[Path, typer.Option("--out", help="Directory for the heatmap PNGs and similarity.json.")],
    max_docs: Annotated[int | None, typer.Option("--max-docs", help="Documents per domain.")] = None,
    max_length: Annotated[
        int, typer.Option("--max-length", help="Tokens per document (the last ones).")
    ] = 512,
    seed: Annotated[int, typer.Option("--seed", help="Seed of a tiny model's weights.")] = 0,
    json_path: JsonOpt = None,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "auto",
) -> None:
    """Domain similarity of expert use per MoE layer (EMO §5.3, Figure 6): heatmaps and a table.

    A plain function, for ``moectl.cli`` to mount as the top-level ``moectl modularity`` verb.
    """
    from moectl.adapters import inspect
    from moectl.models.load import load_model
    from moectl.subsets.similarity import domain_similarity, domain_vectors, plot_similarity

    try:
        texts = texts_by_domain(data, max_docs)
        lm, tokenizer = load_model(model, dtype=dtype, device=device, seed=seed)
        info = inspect(lm)
        similarity = domain_similarity(domain_vectors(lm, tokenizer, texts, info, max_length))
    except _ERRORS as err:
        fail(err)
    domains = list(texts)
    paths = plot_similarity(similarity, domains, out)
    off_diagonal = ~torch.eye(len(domains), dtype=torch.bool)
    table = Table(title=f"domain similarity of expert use ({len(domains)} domains)")
    for column in ("MoE layer", "mean off-diagonal", "min", "max"):
        table.add_column(column, justify="right")
    summary = {}
    for index, matrix in sorted(similarity.items()):
        values = matrix[off_diagonal]
        summary[index] = {
            "mean": float(values.mean()),
            "min": float(values.min()),
            "max": float(values.max()),
        }
        table.add_row(str(index), *(f"{summary[index][key]:.3f}" for key in ("mean", "min", "max")))
    console.print(table)
    result = {
        "model": model,
        "domains": domains,
        "documents": {name: len(docs) for name, docs in texts.items()},
        "similarity": {str(index): matrix.tolist() for index, matrix in similarity.items()},
        "summary": {str(index): values for index, values in summary.items()},
        "plots": [str(p) for p in paths],
    }
    (out / "similarity.json").write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"[dim]wrote {out}/similarity.json and {len(paths)} heatmaps[/dim]")
    write_json(json_path, result)


def texts_by_domain(data: Path, max_docs: int | None, min_domains: int = 2) -> dict[str, list[str]]:
    """``{domain: texts}`` from a directory of DOMAIN.jsonl files or a moectl corpus folder (its
    validation split, grouped by ``domain``); ``min_domains`` is 1 or 2, and with 1 a single JSONL
    file is also accepted (its stem is the domain)."""
    if min_domains <= 1 and data.is_file():
        return {data.stem: read_texts(data, max_docs)}
    texts = corpus_texts_by_domain(data, max_docs) if _is_corpus(data) else {}
    if not texts:
        files = sorted(data.glob("*.jsonl")) if data.is_dir() else []
        if len(files) < min_domains:
            files_needed = "two DOMAIN.jsonl files" if min_domains > 1 else "one DOMAIN.jsonl file"
            raise ValueError(
                f"{data}: needs a directory with at least {files_needed}, or a corpus folder (validation.jsonl "
                "with a 'domain' field)" + (", or one JSONL file" if min_domains <= 1 else "")
            )
        texts = {f.stem: read_texts(f, max_docs) for f in files}
    return texts


def _is_corpus(path: Path) -> bool:
    return path.is_dir() and any((path / f"validation.{ext}").exists() for ext in ("jsonl", "jsonl.gz"))


def corpus_texts_by_domain(path: Path, max_docs: int | None) -> dict[str, list[str]]:
    """Validation documents of a moectl corpus folder, grouped by their ``domain`` field."""
    from moectl.data.sample import iter_documents

    texts: dict[str, list[str]] = {}
    for doc in iter_documents(path, "validation"):
        bucket = texts.setdefault(doc["domain"], [])
        if max_docs is None or len(bucket) < max_docs:
            bucket.append(doc["text"])
    return dict(sorted(texts.items()))


# The other verbs register themselves on ``subset_app`` (kept in their own files to keep this one short).
from moectl.subsets import cli_analysis, cli_train  # noqa: E402, F401
