"""``moectl pretrain`` (and ``python -m moectl.pretrain``, the shim ``accelerate launch`` runs).

moectl pretrain --objective emo --preset small --corpus data/corpus --out runs/emo-small
moectl pretrain --resume runs/emo-small                  # exact resume from the latest checkpoint
accelerate launch --num_processes 2 -m moectl.pretrain --objective emo --preset tiny --out runs/t
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from moectl.cli.common import check_out_file, console, handle_moectl_errors, run_alone, write_json


def pretrain_command(
    out: Annotated[Path | None, typer.Option(help="Run directory (checkpoints, log, final model).")] = None,
    objective: Annotated[str, typer.Option(help="standard | emo (EMO §3.2 document pools).")] = "standard",
    preset: Annotated[str, typer.Option(help="tiny | small.")] = "tiny",
    corpus: Annotated[Path | None, typer.Option(help="Corpus folder; default: the bundled sample.")] = None,
    tokenizer: Annotated[
        Path | None, typer.Option(help="Tokenizer folder; default: the bundled one.")
    ] = None,
    resume: Annotated[Path | None, typer.Option(help="Resume the run in this directory exactly.")] = None,
    anneal_from: Annotated[
        Path | None, typer.Option("--anneal-from", help="Start from this checkpoint (EMO §B.4).")
    ] = None,
    max_steps: Annotated[
        int | None, typer.Option("--max-steps", help="Optimiser steps (default: the preset's).")
    ] = None,
    warmup_steps: Annotated[
        int | None, typer.Option("--warmup-steps", help="Learning-rate warmup steps (default: the preset's).")
    ] = None,
    micro_batch: Annotated[
        int | None, typer.Option("--micro-batch", help="Sequences per forward pass (default: the preset's).")
    ] = None,
    grad_accum: Annotated[
        int | None,
        typer.Option("--grad-accum", help="Micro-batches per optimiser step (default: the preset's)."),
    ] = None,
    seq_len: Annotated[
        int | None, typer.Option("--seq-len", help="Tokens per packed sequence (default: the preset's).")
    ] = None,
    lr: Annotated[float | None, typer.Option(help="Peak learning rate (default: the preset's).")] = None,
    lb_coef: Annotated[
        float | None,
        typer.Option("--lb-coef", help="Load-balancing loss coefficient (default: the preset's)."),
    ] = None,
    lb_scope: Annotated[
        str | None,
        typer.Option(
            "--lb-scope", help="Load-balancing statistics over: micro | dp | global (default: the preset's)."
        ),
    ] = None,
    lb_window: Annotated[
        int | None,
        typer.Option(
            "--lb-window",
            help="Also pool load-balancing counts over this many previous steps (0: none; default: the preset's).",
        ),
    ] = None,
    checkpoint_every: Annotated[
        int | None,
        typer.Option("--checkpoint-every", help="Steps between checkpoints (default: the preset's)."),
    ] = None,
    eval_every: Annotated[
        int | None,
        typer.Option("--eval-every", help="Steps between validation losses (default: the preset's)."),
    ] = None,
    seed: Annotated[
        int | None, typer.Option(help="Seed of weights and data order (default: the preset's).")
    ] = None,
    bf16: Annotated[
        bool | None,
        typer.Option(
            "--bf16/--no-bf16",
            help="bf16 autocast (CPU and GPU); --no-bf16 trains in fp32 (default: the preset's).",
        ),
    ] = None,
    overwrite: Annotated[
        bool, typer.Option(help="Start a new run in an --out that already holds one (its checkpoints go).")
    ] = False,
    json_path: Annotated[
        Path | None,
        typer.Option("--json", help="Also write the final evaluation here.", callback=check_out_file),
    ] = None,
) -> None:
    """Pretrain one of moectl's MoEs with the standard or the EMO objective."""
    from moectl.errors import ConfigError
    from moectl.train.loop import TrainingInterrupted, pretrain
    from moectl.train.train_config import TrainConfig

    overrides = dict(
        max_steps=max_steps,
        warmup_steps=warmup_steps,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        seq_len=seq_len,
        lr=lr,
        lb_coef=lb_coef,
        lb_scope=lb_scope,
        lb_window=lb_window,
        checkpoint_every=checkpoint_every,
        eval_every=eval_every,
        seed=seed,
        bf16=bf16,
    )
    overrides = {k: v for k, v in overrides.items() if v is not None}
    with handle_moectl_errors():
        if resume is not None:  # the saved config, the flags given applied and checked again
            config = TrainConfig.resume_from(resume, **overrides)
        else:
            if out is None:
                raise ConfigError("give --out DIR for a new run (or --resume DIR)")
            config = TrainConfig.from_preset(
                preset,
                out=str(out),
                objective=objective,
                corpus=str(corpus) if corpus else None,
                tokenizer=str(tokenizer) if tokenizer else None,
                anneal_from=str(anneal_from) if anneal_from else None,
                **overrides,
            )
    try:
        with handle_moectl_errors():  # `python -m moectl.pretrain` runs outside MoectlGroup
            result = pretrain(config, resume=resume is not None, overwrite=overwrite)
    except TrainingInterrupted as stopped:
        console.print(f"[yellow]{stopped}[/yellow]")
        raise typer.Exit(code=130) from None
    table = Table(title=f"{config.objective} {config.preset}: validation loss (full model)")
    table.add_column("domain")
    table.add_column("loss", justify="right")
    for domain, value in result["val_loss_per_domain"].items():
        table.add_row(domain, f"{value:.4f}")
    table.add_row("all", f"{result['val_loss']:.4f}")
    console.print(table)
    if result.get("tokens_per_s"):
        console.print(f"training throughput {result['tokens_per_s']:.0f} tokens/s; run in {config.out}")
    write_json(json_path, {"config": config.out, **result})


def main() -> None:
    """``python -m moectl.pretrain`` / ``python -m moectl.cli.pretrain``: the verb alone, under the
    page-keeping allocator."""
    from moectl.train.allocator import reexec_with_fast_allocator

    reexec_with_fast_allocator()
    run_alone(pretrain_command)  # typer.run, its usage errors one line


if __name__ == "__main__":
    main()
