"""``moectl eval``: a (routed) model on benchmarks or a corpus.

    moectl eval MODEL --tasks ... | --perplexity CORPUS

``eval_app`` runs it alone. It prints a rich table and writes its results as JSON (``--out`` /
``--json``). The evaluation sets: ``cli/data.py``; tables of results files: ``cli/report.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from moectl.cli.common import (
    DeviceOpt,
    DtypeOpt,
    EvalsCacheOpt,
    ForceOpt,
    ModelArg,
    MoectlGroup,
    QuantizeOpt,
    check_out_file,
    console,
    interrupted,
    split_list,
    write_json,
)

__all__ = ["eval_app"]

eval_app = typer.Typer(cls=MoectlGroup, help="Evaluate a (routed) model on benchmarks or a corpus.")


def _write_json(path: Path | None, data: Any) -> None:
    write_json(path, data, ensure_ascii=False)


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
        int | None, typer.Option(help="At most N items per task; for --perplexity N documents per domain (the first of each, as options eval --max-docs).")
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
    quantize: QuantizeOpt = None,
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
    force: ForceOpt = False,
) -> None:
    """Evaluate MODEL through lm-eval (moectl as its model backend) or moectl's scorer, routing policies active."""
    from moectl.eval.eval_run import EvalConfig, evaluate
    from moectl.routing.made_for import policy_target

    config = EvalConfig(
        model,
        tasks=split_list(tasks),
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
        quantize=quantize,
    )
    kept = "no results were written (--out is written once every task has finished); run the command again"
    with interrupted(kept), policy_target(model, force=force):  # --policy/--roe made for another model
        doc = evaluate(config)
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
