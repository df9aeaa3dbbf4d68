"""``moectl export ...``: a model in another engine's format (mounted as ``export``).

    moectl export gguf models/moectl-small-standard --out small.gguf
    moectl export gguf models/moectl-small-standard --subset math.subset.json --out math-8.gguf
    moectl export gguf math-8/ --out math-8.gguf          # a folder `moectl subset export` wrote

The GGUF file loads in llama.cpp (and llama-cpp-python: ``pip install 'moectl[llama]'``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from moectl.cli.common import ForceOpt, JsonOpt, MoectlGroup, check_out_file, console, write_json

export_app = typer.Typer(
    cls=MoectlGroup,
    help="Write a model in another engine's format (GGUF for llama.cpp).", no_args_is_help=True
)


@export_app.command("gguf")
def gguf_cmd(
    model: Annotated[
        str,
        typer.Argument(
            help="A checkpoint folder (config.json + safetensors): qwen2_moe, olmoe or qwen3_moe."
        ),
    ],
    out: Annotated[Path, typer.Option("--out", help="The GGUF file to write.", callback=check_out_file)],
    subset: Annotated[
        Path | None,
        typer.Option("--subset", help="Keep only this subset's experts (a `moectl subset select` file)."),
    ] = None,
    outtype: Annotated[
        str, typer.Option("--outtype", help="Matrix dtype: auto (the checkpoint's), f32, f16, bf16.")
    ] = "auto",
    tokenizer: Annotated[
        Path | None,
        typer.Option("--tokenizer", help="Folder of the tokenizer.json to write (default: MODEL's)."),
    ] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing --out file.")] = False,
    force: ForceOpt = False,
    json_path: JsonOpt = None,
) -> None:
    """Write MODEL as one GGUF file llama.cpp loads (tied embeddings untied where llama.cpp needs it)."""
    from moectl.export.to_gguf import write_gguf
    from moectl.routing.made_for import policy_target

    with policy_target(model, force=force):  # a --subset made for another model: refused unless --force
        report = write_gguf(model, out, subset, outtype, tokenizer, overwrite)
    table = Table(title=f"wrote {out}: llama.cpp {report['arch']}, {report['outtype']}")
    table.add_column("")
    table.add_column("", justify="right")
    tok = report["tokenizer"]
    for label, value in (
        ("experts per MoE layer", f"{report['experts']} of {report['experts_source']}"),
        ("tensors", str(report["tensors"])),
        ("file bytes", f"{report['file_bytes']:,}"),
        ("output.weight", "untied copy of the embedding" if report["untied_output"] else "the model's own"),
        ("tokenizer", f"{tok['tokens']} tokens, {tok['merges']} merges, pre-tokenizer {tok['pre']!r}"),
        ("seconds", f"{report['seconds']:.2f}"),
    ):
        table.add_row(label, value)
    console.print(table)
    write_json(json_path, report)
