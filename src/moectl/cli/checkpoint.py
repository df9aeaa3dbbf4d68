"""``moectl checkpoint make``: a real model's shape with random weights, as a sharded checkpoint
(``moectl checkpoint quantize``, a quantized checkpoint: ``cli/checkpoint_quantize.py``).

    moectl checkpoint make shape:olmoe-1b-7b@2 --out /tmp/ck
    moectl checkpoint make shape:deepseek-v2-lite --out ck/ --max-shard-gb 2 --json ck.json

The folder is what ``save_pretrained`` writes for that family (``moectl.models.shapes``): every
verb reads it as MODEL, and ``serve-offload`` streams its experts from the shards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from moectl.cli.checkpoint_quantize import quantize_cmd
from moectl.cli.common import JsonOpt, MoectlGroup, check_out_folder, console, write_json

checkpoint_app = typer.Typer(
    cls=MoectlGroup,
    help="Write checkpoints: real models' shapes (random weights), quantized models.",
    no_args_is_help=True,
)


def _gb(n: int) -> str:
    return f"{n / 1e9:,.3f} GB"


@checkpoint_app.command("make")
def make_cmd(
    spec: Annotated[str, typer.Argument(help="shape:NAME[@LAYERS][~wWIDTH], e.g. shape:olmoe-1b-7b@2.")],
    out: Annotated[
        Path, typer.Option("--out", help="Folder to write (must be empty or new).", callback=check_out_folder)
    ],
    max_shard_gb: Annotated[
        float, typer.Option("--max-shard-gb", help="Largest shard in GB (10^9 bytes), as Hugging Face's 5GB.")
    ] = 5.0,
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a non-empty --out.")] = False,
    json_path: JsonOpt = None,
) -> None:
    """Write SPEC as a sharded safetensors checkpoint with random weights and print its summary."""
    from moectl.errors import ConfigError

    if max_shard_gb <= 0:
        raise ConfigError(f"--max-shard-gb must be > 0, got {max_shard_gb}")
    from moectl.models.shapes import make_checkpoint, parse_shape_spec

    parse_shape_spec(spec)  # a bad spec names the known shapes before any work
    summary = make_checkpoint(spec, out, int(max_shard_gb * 1e9), seed=seed, overwrite=overwrite)
    params = summary["parameters"]
    table = Table(title=f"moectl checkpoint make {summary['spec']} → {summary['path']}", show_header=False)
    rows = [
        ("model type", f"{summary['model_type']} ({summary['architecture']})"),
        ("layers / hidden size", f"{summary['num_layers']} / {summary['hidden_size']}"),
        ("dtype / seed", f"{summary['dtype']} / {summary['seed']}"),
        ("bytes on disk", f"{summary['bytes']:,} ({_gb(summary['bytes'])})"),
        ("shards", str(summary["shards"])),
        ("tensors", f"{summary['tensors']:,}"),
        *((f"parameters: {key}", f"{value:,}") for key, value in params.items()),
        ("expert bytes", f"{summary['expert_bytes']:,} ({_gb(summary['expert_bytes'])})"),
        ("non-expert bytes", f"{summary['non_expert_bytes']:,} ({_gb(summary['non_expert_bytes'])})"),
        ("seconds", f"{summary['seconds']:.1f}"),
    ]
    for row in rows:
        table.add_row(*row)
    console.print(table)
    write_json(json_path, summary)


checkpoint_app.command("quantize")(quantize_cmd)  # issue 40 item 2: cli/checkpoint_quantize.py
