"""``moectl checkpoint quantize``: write a quantized checkpoint once, so serving loads it quantized.

    moectl checkpoint quantize models/moectl-small-standard --out ck/small-int4 --quantize int4
    moectl checkpoint quantize shape:olmoe-1b-7b@2 --out ck/olmoe2-int8 --quantize int8 --scope all

Issue 40 item 2. The folder (``moectl.quant.checkpoint_format``) is read by ``moectl.load`` and every
verb as MODEL, quantized without quantizing again. Written beside ``--out`` and renamed into place:
an error or Ctrl-C leaves nothing half-written. Bad input: one line, exit code 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from moectl.cli.common import (
    DtypeOpt,
    JsonOpt,
    ModelArg,
    check_out_folder,
    check_quantize,
    console,
    fail,
    interrupted,
    write_json,
)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def quantize_cmd(
    model: ModelArg,
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            help="Folder to write (must be new or empty; see --overwrite).",
            callback=check_out_folder,
        ),
    ],
    quantize: Annotated[
        str,
        typer.Option(
            "--quantize",
            help="int4 (group-wise, PyTorch's CPU kernel) or int8 (per output channel).",
            callback=check_quantize,
        ),
    ],
    group_size: Annotated[
        int, typer.Option("--group-size", help="int4: inputs per scale and zero, 32, 64, 128 or 256.")
    ] = 64,
    scope: Annotated[
        str, typer.Option("--scope", help="experts (routed and shared) | all (every Linear but the routers).")
    ] = "experts",
    dtype: DtypeOpt = "auto",
    max_shard_gb: Annotated[
        float, typer.Option("--max-shard-gb", help="Largest safetensors shard in GB (10^9 bytes).")
    ] = 5.0,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a non-empty --out.")] = False,
    json_path: JsonOpt = None,
) -> None:
    """Quantize MODEL's experts (int4 or int8) and write them as a checkpoint that loads quantized."""
    from moectl.errors import ConfigError
    from moectl.quant.quantize_checkpoint import check_request, quantize_checkpoint

    if max_shard_gb <= 0:
        raise ConfigError(f"--max-shard-gb must be > 0, got {max_shard_gb}")
    check_request(model, out, quantize, group_size, scope, overwrite)  # every refusal before the model loads
    with interrupted(f"nothing written: {out} is as it was"):
        try:
            summary = quantize_checkpoint(
                model, out, quantize, group_size=group_size, scope=scope, dtype=dtype, overwrite=overwrite,
                max_shard_bytes=int(max_shard_gb * 1e9),
            )  # fmt: skip
        except OSError as err:  # a full disk, a folder gone: atomic_dir left --out as it was
            fail(f"--out {out} not written: {err}")
    q, seconds = summary["quantize"], summary["seconds"]
    group = f", groups of {q['group_size']}" if q["group_size"] else ""
    table = Table(title=f"moectl checkpoint quantize {model} → {out}", show_header=False)
    rows = [
        ("scheme", f"{q['scheme']}{group}, scope {q['scope']}"),
        ("quantized", f"{q['experts_modules']} experts modules, {q['linear_modules']} linear layers"),
        (f"bytes before ({summary['bytes_before_source']})", _mib(summary["bytes_before"])),
        ("bytes after (the folder)", _mib(summary["bytes_after"])),
        ("model in memory", f"{_mib(q['model_bytes_before'])} → {_mib(q['model_bytes_after'])}"),
        ("files", str(len(summary["files"]))),
        ("seconds", f"{seconds['total']:.1f} (load {seconds['load']:.1f}, quantize "
                    f"{seconds['quantize']:.1f}, write {seconds['write']:.1f})"),
    ]  # fmt: skip
    for row in rows:
        table.add_row(*row)
    console.print(table)
    write_json(json_path, summary)
