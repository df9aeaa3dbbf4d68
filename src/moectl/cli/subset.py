"""``moectl subset ...``: per-domain expert subsets from the command line (mounted as ``subset``).

    moectl subset select MODEL --data math_val.jsonl --keep 8 --method router --out math.subset.json
    moectl subset export MODEL --subset math.subset.json --out math-8/
    moectl subset finetune math-8/ --data math_train.jsonl --out math-8-ft/   # subset_finetune.py
    moectl subset merge MODEL --subset math.subset.json --experts math-8-ft/ --out merged/
    moectl subset gate MODEL --subset math.subset.json --data domains/ --json gate.json
    moectl subset clusters MODEL --data domains/ --out clusters/

MODEL is ``tiny:FAMILY`` (an offline random model), a checkpoint directory or a hub id. ``--data``
is JSONL with a ``text`` field per line; for ``gate`` and ``clusters`` (and ``moectl modularity``, ``cli/modularity.py``) a directory of
DOMAIN.jsonl files or a moectl corpus folder (its validation split, by ``domain``; ``clusters`` and
``gate`` also take one JSONL file), read by ``moectl.data.domains.texts_by_domain``. Each verb
prints a rich table and writes its results with ``--json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from moectl.cli.common import (
    DeviceOpt,
    DtypeOpt,
    ForceOpt,
    JsonOpt,
    ModelArg,
    MoectlGroup,
    check_out_file,
    check_out_folder,
    console,
    err_console,
    load,
    write_json,
    write_or_fail,
)
from moectl.io.atomic import write_text_atomic

subset_app = typer.Typer(
    cls=MoectlGroup,
    help="Per-domain expert subsets: select, export, finetune, merge, gate, clusters (EMO §4.2, §5.2, §5.3, §6, C).",
    no_args_is_help=True,
)


DataOpt = Annotated[
    Path,
    typer.Option(
        "--data", help="Directory of DOMAIN.jsonl files ('text' per line), or a moectl corpus folder."
    ),
]
MaxDocsOpt = Annotated[int | None, typer.Option("--max-docs", help="Documents per domain.")]
MaxLengthOpt = Annotated[int, typer.Option("--max-length", help="Tokens per document (the last ones).")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of a tiny model's weights.")]


@subset_app.command("select")
def select_cmd(
    model: ModelArg,
    data: Annotated[Path, typer.Option("--data", help="Calibration JSONL with a 'text' field per line.")],
    keep: Annotated[int, typer.Option("--keep", help="Experts kept in every MoE layer.")],
    out: Annotated[Path, typer.Option("--out", help="Subset file to write (JSON).", callback=check_out_file)],
    method: Annotated[
        str, typer.Option("--method", help="router | frequency | easy-ep | reap | reconstruction | wanda | random")
    ] = "router",
    layerwise: Annotated[
        bool, typer.Option("--layerwise", help="Prune layer l before measuring layer l+1.")
    ] = False,
    max_docs: Annotated[int | None, typer.Option("--max-docs", help="Use the first N documents.")] = None,
    max_length: MaxLengthOpt = 512,
    seed: Annotated[int, typer.Option("--seed", help="Seed (random method; tiny model weights).")] = 0,
    json_path: JsonOpt = None,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "auto",
) -> None:
    """Select the experts to keep per MoE layer from a small calibration set."""
    from moectl.adapters import inspect
    from moectl.data.domains import read_texts
    from moectl.subsets.calibrate import tokenize
    from moectl.subsets.files import save_subset
    from moectl.subsets.select import method_name, select_subset

    method = method_name(method)
    texts = read_texts(data, max_docs)
    lm, tokenizer = load(model, device, dtype, seed=seed)
    info = inspect(lm)
    batch = tokenize(tokenizer, texts, max_length)
    kept = select_subset(
        lm, batch["input_ids"], keep, method, batch["attention_mask"], layerwise, seed, info, progress=True
    )
    calibration = {
        "data": str(data),
        "documents": len(texts),
        "tokens": int(batch["attention_mask"].sum()),
        "max_length": max_length,
        "layerwise": layerwise,
        "seed": seed,
    }
    write_or_fail(
        "--out", save_subset, out, kept, model=model, method=method, calibration=calibration,
        num_experts=info.num_experts,
    )  # fmt: skip
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
    out: Annotated[
        Path, typer.Option("--out", help="Directory for the smaller checkpoint.", callback=check_out_folder)
    ],
    seed: SeedOpt = 0,
    json_path: JsonOpt = None,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "auto",
    stream: Annotated[
        bool | None,
        typer.Option(
            "--stream/--no-stream",
            help="Read and write a checkpoint folder shard by shard, never loading the model (default: on "
            "for a checkpoint folder; --dtype and --device then do not apply: tensors are copied as stored).",
        ),
    ] = None,
    force: ForceOpt = False,
) -> None:
    """Slice the unselected experts out and save a checkpoint plain transformers loads."""
    from moectl.adapters import inspect
    from moectl.models.load_lazy import is_checkpoint_folder
    from moectl.routing.made_for import policy_target
    from moectl.subsets.export import check_out_dir, export_subset
    from moectl.subsets.files import load_subset

    check_out_dir(out)  # before the model loads: an existing checkpoint (or MODEL itself) is never written into
    if stream is None:
        stream = is_checkpoint_folder(model) and dtype == "auto"
    if stream:
        _export_streamed(model, subset, out, json_path, force)
        return
    try:
        lm, tokenizer = load(model, device, dtype, seed=seed)
    except (OSError, ValueError):  # a checkpoint without a (loadable) tokenizer: weights only
        lm, tokenizer = load(model, device, dtype, seed=seed, with_tokenizer=False)
        console.print(f"[yellow]note:[/yellow] no tokenizer loads from {model}; exporting weights only")
    info = inspect(lm)
    with policy_target(model, force=force):  # a subset made for another model: refused unless --force
        chosen = load_subset(subset, info)
    warn_mismatch(subset, chosen, model, info)
    source = Path(model) if Path(model).is_dir() else None
    metadata = {"model": model, "subset_file": str(subset), "method": chosen.method,
                "calibration": chosen.calibration}  # fmt: skip
    report = export_subset(lm, chosen.keep, out, tokenizer, info, metadata, source, in_place=True)
    _print_export(out, report)
    write_json(json_path, report)


def warn_mismatch(path: Path, chosen, model: str, info) -> None:
    """``warning: ...`` on standard error when the subset file was chosen on another model."""
    from moectl.subsets.files import subset_mismatch

    note = subset_mismatch(path, chosen, model, info)
    if note:
        err_console.print(f"[yellow]warning:[/yellow] {escape(note)}")


def _print_export(out: Path, report: dict, how: str = "") -> None:
    """The before/after table of an export, after a note per stale temporary folder it removed."""
    for path in report.get("stale_removed", []):
        console.print(f"[yellow]note:[/yellow] removed {escape(path)}, left by an export killed mid-way")
    title = f"exported {out}: {report['experts_after']} experts per MoE layer" + (f", {how}" if how else "")
    table = Table(title=title)
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


def _export_streamed(model: str, subset: Path, out: Path, json_path: Path | None, force: bool = False) -> None:
    """``subset export`` of a checkpoint folder, shard by shard (``moectl.subsets.export_stream``)."""
    from moectl.adapters import inspect
    from moectl.errors import ConfigError
    from moectl.models.load_lazy import is_checkpoint_folder
    from moectl.models.meta_model import build_meta, load_config
    from moectl.routing.made_for import policy_target
    from moectl.subsets.export_stream import export_checkpoint_subset
    from moectl.subsets.files import load_subset

    if not is_checkpoint_folder(model):
        raise ConfigError(f"--stream needs a checkpoint folder with safetensors shards, got {model!r}")
    meta_info = inspect(build_meta(load_config(model)))
    with policy_target(model, force=force):
        chosen = load_subset(subset, meta_info)
    warn_mismatch(subset, chosen, model, meta_info)
    metadata = {"model": model, "subset_file": str(subset), "method": chosen.method,
                "calibration": chosen.calibration}  # fmt: skip
    report = export_checkpoint_subset(model, chosen.keep, out, metadata)
    _print_export(out, report, "streamed shard by shard")
    write_json(json_path, report)


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
    max_length: MaxLengthOpt = 512,
    seed: SeedOpt = 0,
    json_path: JsonOpt = None,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "auto",
    force: ForceOpt = False,
) -> None:
    """Per-domain loss with and without the subset's experts blocked (EMO §6, fine-grained control)."""
    from moectl.adapters import inspect
    from moectl.data.domains import texts_by_domain
    from moectl.routing.made_for import policy_target
    from moectl.subsets.files import load_subset
    from moectl.subsets.gating import gate_report

    texts = texts_by_domain(data, "validation", max_docs)
    lm, tokenizer = load(model, device, dtype, seed=seed)
    info = inspect(lm)
    with policy_target(model, force=force):
        chosen = load_subset(subset, info)
    warn_mismatch(subset, chosen, model, info)
    own = domain or Path(str(chosen.calibration.get("data", ""))).stem
    report = gate_report(lm, tokenizer, texts, chosen.keep, info, own, max_length)
    own, rows = report["domain"], report["domains"]
    table = Table(
        title=f"blocking {subset.name}: {report['blocked_experts']} of {info.num_experts} experts per MoE layer"
    )
    for column in ("domain", "loss", "blocked", "increase", "relative"):
        table.add_column(column, justify="right")
    for name, row in rows.items():
        label = f"[bold]{name} *[/bold]" if name == own else name
        table.add_row(label, f"{row['full']:.4f}", f"{row['blocked']:.4f}", f"{row['increase']:+.4f}",
                      f"{row['relative']:+.1%}")  # fmt: skip
    console.print(table)
    if "selectivity" in report:
        mine, selectivity = rows[own]["increase"], report["selectivity"]
        console.print(
            f"{own} (*) loses {mine:+.4f}; the other domains {mine - selectivity:+.4f} "
            f"on average; selectivity {selectivity:+.4f}"
        )
    write_json(json_path, {"model": model, "subset": str(subset), **report})


@subset_app.command("clusters")
def clusters_cmd(
    model: ModelArg,
    data: Annotated[
        Path,
        typer.Option("--data", help="A JSONL file, a directory of DOMAIN.jsonl files or a corpus folder."),
    ],
    out: Annotated[
        Path, typer.Option("--out", help="Directory for clusters.json.", callback=check_out_folder)
    ],
    clusters: Annotated[int, typer.Option("--clusters", help="k of spherical k-means (EMO: 32).")] = 32,
    first: Annotated[int, typer.Option("--first", help="Tokens per document (the first; EMO: 100).")] = 100,
    variance: Annotated[float, typer.Option("--variance", help="PCA variance kept (EMO: 0.95).")] = 0.95,
    top: Annotated[int, typer.Option("--top", help="Most frequent tokens listed per cluster.")] = 10,
    max_docs: MaxDocsOpt = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of a tiny model's weights and of k-means.")] = 0,
    json_path: JsonOpt = None,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "auto",
) -> None:
    """Cluster tokens by their routing (EMO §5.3, appendix D): frequent tokens, document purity."""
    from moectl.data.domains import texts_by_domain
    from moectl.errors import ConfigError
    from moectl.subsets.clusters import cluster_report, cluster_tokens

    if not 0 < variance <= 1:
        raise ConfigError(f"--variance must lie in (0, 1], got {variance}")
    if clusters < 1 or first < 1:
        raise ConfigError("--clusters and --first must be at least 1")
    texts = texts_by_domain(data, "validation", max_docs)
    docs = [(name, text) for name, bucket in texts.items() for text in bucket]
    lm, tokenizer = load(model, device, dtype, seed=seed)
    result = cluster_tokens(lm, tokenizer, [t for _, t in docs], clusters, first, variance, seed, top)
    report = cluster_report(result, [name for name, _ in docs], tokenizer)
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
    write_or_fail("--out", write_text_atomic, out / "clusters.json", json.dumps(data_out, indent=2) + "\n")
    console.print(f"[dim]wrote {out}/clusters.json[/dim]")
    write_json(json_path, data_out)


# finetune and merge register themselves on ``subset_app`` (their own file keeps this one short).
from moectl.cli import subset_finetune  # noqa: E402, F401
