"""``moectl report results/*.json``: results files as the papers' tables (Markdown) and a plot.

``report_app`` runs it alone. It prints a rich table and writes the rows as JSON with ``--json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from moectl.cli.common import MoectlGroup, check_out_file, console, fail, split_list, write_json

__all__ = ["report_app"]

report_app = typer.Typer(cls=MoectlGroup, help="Render results files as the papers' tables and a plot.")


@report_app.callback(invoke_without_command=True, context_settings={"allow_interspersed_args": True})
def report_command(
    files: Annotated[list[Path], typer.Argument(help="Results JSON files (moectl eval --out).")],
    markdown: Annotated[
        Path | None, typer.Option("--markdown", help="Write the Markdown table here.", callback=check_out_file)
    ] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write the PNG plot here.", callback=check_out_file)] = None,
    tasks: Annotated[str | None, typer.Option("--tasks", help="Columns to show, in order.")] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Also write the rows as JSON.", callback=check_out_file)] = None,
) -> None:
    """Model × benchmark table with 95% intervals (and switch % under a mask or controller)."""
    from moectl.eval.report import report

    try:
        result = report(files, markdown, plot, split_list(tasks) or None)
    except (ValueError, OSError) as err:
        fail(err)
    table = Table(title="results")
    table.add_column("model")
    table.add_column("routing")
    for col in result["columns"]:
        table.add_column(col, justify="right")
    table.add_column("switch %", justify="right")
    for row in result["rows"]:
        cells = [row["text"].get(col, "–") for col in result["columns"]]
        sr = row["switch_rate"]
        table.add_row(row["model"], row["routing"], *cells, "–" if sr is None else f"{100 * sr:.1f}")
    console.print(table)
    for key in ("markdown_path", "plot_path"):
        if key in result:
            console.print(f"[dim]wrote {result[key]}[/dim]")
    write_json(json_path, {k: v for k, v in result.items() if k != "markdown"}, ensure_ascii=False)
