"""``moectl modularity MODEL --data domains/ --out report/``: domain similarity of expert use per MoE
layer (EMO §5.3, Figure 6), heatmaps and a table.

``--data`` is a directory of DOMAIN.jsonl files or a moectl corpus folder (its validation split), as
for ``moectl subset gate``; ``--json`` also writes the result.
"""

from __future__ import annotations

import json
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
    write_or_fail,
)
from moectl.cli.subset import DataOpt, MaxDocsOpt, MaxLengthOpt, SeedOpt
from moectl.io.atomic import write_text_atomic

__all__ = ["modularity_cmd"]


def modularity_cmd(
    model: ModelArg,
    data: DataOpt,
    out: Annotated[
        Path,
        typer.Option(
            "--out", help="Directory for the heatmap PNGs and similarity.json.", callback=check_out_folder
        ),
    ],
    max_docs: MaxDocsOpt = None,
    max_length: MaxLengthOpt = 512,
    seed: SeedOpt = 0,
    json_path: JsonOpt = None,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "auto",
) -> None:
    """Domain similarity of expert use per MoE layer (EMO §5.3, Figure 6): heatmaps and a table."""
    from moectl.adapters import inspect
    from moectl.data.domains import texts_by_domain
    from moectl.subsets.similarity import modularity_report

    texts = texts_by_domain(data, "validation", max_docs, min_domains=2)
    lm, tokenizer = load(model, device, dtype, seed=seed)
    report = modularity_report(lm, tokenizer, texts, out, inspect(lm), max_length, progress=True)
    table = Table(title=f"domain similarity of expert use ({len(report['domains'])} domains)")
    for column in ("MoE layer", "mean off-diagonal", "min", "max"):
        table.add_column(column, justify="right")
    for index, summary in report["summary"].items():
        table.add_row(index, *(f"{summary[key]:.3f}" for key in ("mean", "min", "max")))
    console.print(table)
    result = {"model": model, **report}
    write_or_fail("--out", write_text_atomic, out / "similarity.json", json.dumps(result, indent=2) + "\n")
    console.print(f"[dim]wrote {out}/similarity.json and {len(report['plots'])} heatmaps[/dim]")
    write_json(json_path, result)
