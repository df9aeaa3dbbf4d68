"""``moectl card``: a Hugging Face model card for a model moectl pretrained, every figure from files.

    moectl card models/moectl-ref-standard --run runs/ref-standard \\
        --effective-experts benchmarks/results/effective_experts.json \\
        --effective-plot benchmarks/results/effective_experts.png --eval benchmarks/results/eval/ppl.json
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moectl.cli.common import JsonOpt, console, fail, output_problem, write_json


def card_command(
    model_dir: Annotated[
        Path, typer.Argument(help="The model folder (config.json + safetensors) to write README.md into.")
    ],
    run: Annotated[Path, typer.Option("--run", help="The `moectl pretrain` run folder that trained it.")],
    effective_experts: Annotated[
        Path | None,
        typer.Option("--effective-experts", help="benchmarks/effective_experts.py --json result to report."),
    ] = None,
    effective_plot: Annotated[
        Path | None, typer.Option("--effective-plot", help="Its PNG, copied beside the card.")
    ] = None,
    evals: Annotated[
        list[Path] | None,
        typer.Option("--eval", help="A `moectl eval --json` result to report (repeatable)."),
    ] = None,
    corpus: Annotated[
        Path | None,
        typer.Option("--corpus", help="The corpus folder (default: the run's config.json names it)."),
    ] = None,
    name: Annotated[
        str | None, typer.Option("--name", help="Model name (default: the folder's name).")
    ] = None,
    license: Annotated[
        str | None, typer.Option("--license", help="The card's license id (default: moectl's, apache-2.0).")
    ] = None,
    json_path: JsonOpt = None,
) -> None:
    """Write MODEL_DIR/README.md (Hugging Face model card) and copy the training log and curves beside it."""
    from moectl.errors import MoectlFileError
    from moectl.reporting.model_card import CARD, write_card

    if not model_dir.is_dir():
        raise MoectlFileError(f"{model_dir}: no such model folder")
    problem = output_problem(model_dir / CARD)  # the card is written into MODEL_DIR: writable?
    if problem:
        fail(problem)
    result = write_card(
        model_dir, run, effective_experts=effective_experts, effective_plot=effective_plot,
        evals=list(evals or []), corpus=corpus, name=name, license=license,
    )  # fmt: skip
    for path in result["written"]:
        console.print(f"[dim]wrote {path}[/dim]")
    for m in result["metrics"]:
        console.print(f"{m['name']}: {m['value']:.4f}")
    write_json(json_path, result)
