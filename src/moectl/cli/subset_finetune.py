"""``moectl subset finetune`` and ``moectl subset merge`` (EMO appendix C, §6), on ``subset_app``
(:mod:`moectl.cli.subset`).

    moectl subset finetune math-8/ --data math_train.jsonl --out math-8-ft/ [--lora 8]
    moectl subset merge MODEL --subset math.subset.json --experts math-8-ft/ --out merged/

``finetune`` trains an exported subset checkpoint (``moectl subset export``) on JSONL lines
``{"prompt", "response"}`` / ``{"prompt", "completion"}`` (loss on the response only) or
``{"text"}`` (loss on every token), with EMO's defaults: one epoch, effective batch 32, lr 5e-5,
AdamW, linear decay without warmup. ``merge`` writes the fine-tuned experts (and their router
rows) back into the full model at the kept indices.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from moectl.cli.common import (
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    ModelArg,
    check_out_folder,
    console,
    load,
    write_json,
)
from moectl.cli.subset import subset_app, warn_mismatch

OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace --out if it exists.")]


@subset_app.command("finetune")
def finetune_cmd(
    checkpoint: Annotated[str, typer.Argument(help="Exported subset checkpoint (or any model spec).")],
    data: Annotated[Path, typer.Option("--data", help="JSONL: prompt+response/completion, or text.")],
    out: Annotated[
        Path,
        typer.Option("--out", help="Directory for the fine-tuned checkpoint.", callback=check_out_folder),
    ],
    epochs: Annotated[int, typer.Option("--epochs", help="Passes over the data (EMO: 1).")] = 1,
    lr: Annotated[float, typer.Option("--lr", help="Peak learning rate (EMO: 5e-5).")] = 5e-5,
    batch_size: Annotated[
        int, typer.Option("--batch-size", help="Examples per optimiser step (EMO: 32).")
    ] = 32,
    micro_batch_size: Annotated[
        int, typer.Option("--micro-batch-size", help="Examples per forward pass (gradient accumulation).")
    ] = 8,
    max_length: Annotated[int, typer.Option("--max-length", help="Tokens per example.")] = 512,
    schedule: Annotated[
        str, typer.Option("--schedule", help="linear (decay to 0; HF default, EMO) | constant | cosine")
    ] = "linear",
    warmup_ratio: Annotated[float, typer.Option("--warmup-ratio", help="Warmup fraction (EMO: 0).")] = 0.0,
    weight_decay: Annotated[float, typer.Option("--weight-decay", help="AdamW weight decay.")] = 0.0,
    lora: Annotated[
        int | None, typer.Option("--lora", help="Train LoRA adapters of this rank, merged before saving.")
    ] = None,
    max_steps: Annotated[int | None, typer.Option("--max-steps", help="Stop after N steps.")] = None,
    max_examples: Annotated[
        int | None, typer.Option("--max-examples", help="Use the first N examples.")
    ] = None,
    tokenizer: Annotated[
        str | None, typer.Option("--tokenizer", help="Tokenizer path or hub id; 'bytes' for tiny models.")
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Data order (and a tiny model's weights).")] = 0,
    overwrite: OverwriteOpt = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")] = True,
    json_path: JsonOpt = None,
    device: DeviceOpt = "cpu",
    dtype: Annotated[str, typer.Option("--dtype", help="float32 (default), bfloat16, auto.")] = "float32",
    no_master_weights: Annotated[
        bool,
        typer.Option(
            "--no-master-weights",
            help="bf16/fp16 weights: step them in place, not through float32 masters (saves 8 bytes "
            "per trained weight; most updates then round away).",
        ),
    ] = False,
) -> None:
    """Fine-tune a subset checkpoint, prompt tokens masked (EMO appendix C); saves it atomically.

    Data parallel: put ``accelerate launch --multi_gpu --num_processes 2 -m`` before ``moectl subset finetune``.
    Each process then takes batch_size / 2 examples of every step; gradients are summed over the processes."""
    from moectl.distributed import check_divides, launched_world_size, ranks
    from moectl.subsets.checkpoint_files import check_out, load_tokenizer, subset_metadata
    from moectl.subsets.finetune import FinetuneConfig, finetune_subset, save_finetuned
    from moectl.subsets.finetune_data import read_examples

    check_out(out, overwrite)
    config = FinetuneConfig(
        epochs=epochs, lr=lr, batch_size=batch_size, micro_batch_size=micro_batch_size,
        max_length=max_length, schedule=schedule, warmup_ratio=warmup_ratio,
        weight_decay=weight_decay, lora=lora, max_steps=max_steps, seed=seed,
        master_weights=not no_master_weights,
    )  # fmt: skip
    check_divides(batch_size, launched_world_size(), "examples per optimiser step")
    examples = read_examples(data, max_examples)
    processes = ranks()
    source = Path(checkpoint) if Path(checkpoint).is_dir() else None
    metadata = subset_metadata(source) if source else {}
    model, _ = load(checkpoint, device, dtype, seed=seed, with_tokenizer=False)
    tok, note = load_tokenizer(checkpoint, tokenizer, metadata)
    if note and processes.is_main:
        console.print(f"[dim]{note}[/dim]")
    log = finetune_subset(model, tok, examples, config, progress=progress, processes=processes)
    log.update(checkpoint=checkpoint, data=str(data), processes=processes.world)
    path = save_finetuned(model, tok, out, log, source, overwrite=overwrite) if processes.is_main else out
    processes.barrier()  # the others end once rank 0 has written the checkpoint
    if not processes.is_main:
        return
    steps = log["steps"]
    table = Table(title=f"fine-tuned {checkpoint} → {path}")
    for column in ("examples", "output tokens", "steps", "first loss", "final loss", "seconds"):
        table.add_column(column, justify="right")
    table.add_row(
        f"{log['examples']}" + (f" ({log['skipped']} skipped)" if log["skipped"] else ""),
        f"{log['output_tokens']:,}", str(len(steps)), f"{steps[0]['loss']:.4f}",
        f"{steps[-1]['loss']:.4f}", f"{log['seconds']:.1f}",
    )  # fmt: skip
    console.print(table)
    console.print(f"[dim]wrote {path} (finetune.json, loss_curve.png)[/dim]")
    write_json(json_path, {**log, "out": str(path)})


@subset_app.command("merge")
def merge_cmd(
    model: ModelArg,
    experts: Annotated[Path, typer.Option("--experts", help="Fine-tuned subset checkpoint directory.")],
    out: Annotated[
        Path, typer.Option("--out", help="Directory for the merged full model.", callback=check_out_folder)
    ],
    subset: Annotated[
        Path | None,
        typer.Option("--subset", help="Subset file (default: the kept experts recorded in --experts)."),
    ] = None,
    router: Annotated[
        bool, typer.Option("--router/--no-router", help="Also write the kept experts' router rows.")
    ] = True,
    all_weights: Annotated[
        bool, typer.Option("--all-weights", help="Also take the subset's shared weights (beyond EMO §6).")
    ] = False,
    seed: Annotated[int, typer.Option("--seed", help="Seed of a tiny model's weights.")] = 0,
    overwrite: OverwriteOpt = False,
    json_path: JsonOpt = None,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "auto",
) -> None:
    """Write fine-tuned subset experts back into the full model at the kept indices (EMO §6)."""
    from moectl.adapters import inspect
    from moectl.errors import ConfigError, MoectlFileError
    from moectl.subsets.checkpoint_files import check_out, has_tokenizer, subset_metadata
    from moectl.subsets.files import load_subset
    from moectl.subsets.merge import merge_subset, save_merged

    check_out(out, overwrite)
    if not experts.is_dir():
        raise MoectlFileError(f"--experts {experts} is not a checkpoint directory")
    local = Path(model).is_dir()
    with_tokenizer = has_tokenizer(Path(model)) if local else not model.startswith("tiny:")
    full, tokenizer = load(model, device, dtype, seed=seed, with_tokenizer=with_tokenizer)
    info = inspect(full)
    metadata = subset_metadata(experts)
    recorded = metadata.get("keep")
    if metadata.get("model") not in (None, model):
        console.print(
            f"[yellow]warning:[/yellow] {experts} was exported from {metadata['model']}, merging into {model}"
        )
    if subset is not None:
        chosen = load_subset(subset, info)
        warn_mismatch(subset, chosen, model, info)
        keep = chosen.keep
        if recorded is not None and {int(k): v for k, v in recorded.items()} != keep:
            raise ConfigError(f"{subset} keeps other experts than {experts} was exported with")
    elif recorded is not None:
        keep = {int(k): list(v) for k, v in recorded.items()}
    else:
        raise ConfigError(f"{experts} records no kept experts (moectl_subset.json); pass --subset")
    sub, _ = load(str(experts), device, "auto", with_tokenizer=False)
    report = merge_subset(full, sub, keep, router=router, all_weights=all_weights, info=info)
    meta = {"model": model, "experts": str(experts), "subset": str(subset) if subset else None, **report}
    path = save_merged(full, out, tokenizer, meta, overwrite=overwrite)
    parts = "experts + router rows" if router else "experts"
    table = Table(title=f"merged {experts} into {model} → {path} ({parts})")
    for column in ("MoE layer", "experts written", "max |Δ|"):
        table.add_column(column, justify="right")
    for index, row in sorted(report["layers"].items()):
        table.add_row(str(index), " ".join(map(str, row["experts"])), f"{row['max_change']:.3g}")
    console.print(table)
    if all_weights:
        console.print(
            f"shared weights: {report['shared_tensors_written']} tensors, max |Δ| "
            f"{report['shared_max_change']:.3g}"
        )
    write_json(json_path, {**meta, "out": str(path)})
