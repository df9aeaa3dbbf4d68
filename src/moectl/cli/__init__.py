"""``moectl`` command line: each verb prints a rich table and writes the same results with --json."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from moectl.cli_common import JsonOpt, OptionalModelArg, TinyOpt, console, fail, model_spec, write_json
from moectl.models.tiny import FAMILIES

app = typer.Typer(help="Control expert routing in Mixture-of-Experts language models.", no_args_is_help=True)


@app.command("inspect")
def inspect_cmd(model: OptionalModelArg = None, tiny: TinyOpt = None, json_path: JsonOpt = None) -> None:
    """Family, MoE layers, experts per layer, top-k, shared experts, router rule, adapter self-test."""
    from moectl.commands.inspect import run_inspect

    try:
        info = run_inspect(model_spec(model, tiny))
    except (ValueError, OSError) as err:
        fail(err)
    table = Table(title=f"moectl inspect {info['model']}", show_header=False)
    for key in (
        "family",
        "router_class",
        "router_rule",
        "num_layers",
        "moe_layers",
        "dense_layers",
        "num_experts",
        "top_k",
        "shared_experts",
        "parameters",
    ):
        table.add_row(key, str(info[key]))
    table.add_row("rule", ", ".join(f"{k}={v}" for k, v in info["rule"].items()))
    st = info["self_test"]
    verdict = "[green]PASS[/green]" if st["passed"] else "[red]FAIL[/red]"
    table.add_row(
        "self-test",
        f"{verdict} ({st['layers_checked']} layers, {st['index_mismatches']} index mismatches, "
        f"max weight error {st['max_weight_error']:.1e})",
    )
    console.print(table)
    write_json(json_path, info)
    if not st["passed"]:
        raise typer.Exit(code=1)


@app.command("switch-rate")
def switch_rate_cmd(
    model: OptionalModelArg = None,
    tiny: TinyOpt = None,
    prompts: Annotated[
        Path | None, typer.Option(help="JSONL with 'prompt' (and 'category'); default: built-in.")
    ] = None,
    k_hat: Annotated[
        int | None, typer.Option("--k-hat", help="Experts an option keeps (default: top-k).")
    ] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens")] = 256,
    temperature: float = 0.5,
    batch_size: Annotated[int, typer.Option("--batch-size")] = 8,
    seed: int = 0,
    plot: Annotated[
        Path | None, typer.Option(help="Directory for the PNG figures (TE-MoE Figure 2).")
    ] = None,
    trace: Annotated[
        Path | None, typer.Option(help="Save the routing trace here (.safetensors + .json).")
    ] = None,
    policy: Annotated[
        str | None,
        typer.Option(
            help="Generate under a policy: a policy file or folder (subset, mask, controller run, ...) or "
            "option:K_HAT; a controller's (or full mask's) recorded mask is ω."
        ),
    ] = None,
    json_path: JsonOpt = None,
) -> None:
    """Generate, record routing and report the switch rate (TE-MoE §2.2, Table 1) per layer and category."""
    from moectl.commands.switch_rate import run_switch_rate

    try:
        result = run_switch_rate(
            model_spec(model, tiny),
            str(prompts) if prompts else None,
            k_hat,
            max_new_tokens,
            temperature,
            batch_size,
            seed,
            str(plot) if plot else None,
            str(trace) if trace else None,
            policy=policy,
        )
    except (ValueError, OSError) as err:
        fail(err)
    cats = result["categories"]
    omega = "recorded mask" if result["source"] == "allowed" else f"k-hat = {result['k_hat']}"
    table = Table(title=f"Switch rate (mean ± std over prompts), {omega}, top-k = {result['top_k']}")
    table.add_column("model")
    for cat in cats:
        table.add_column(cat, justify="right")
    table.add_column("all", justify="right")
    table.add_row(
        result["model"],
        *[f"{v['mean']:.2f}±{v['std']:.2f}" for v in cats.values()],
        f"{result['overall']['mean']:.2f}±{result['overall']['std']:.2f}",
    )
    console.print(table)
    layers = Table(title="Switch rate per MoE layer")
    layers.add_column("MoE layer")
    layers.add_column("decoder layer")
    for cat in cats:
        layers.add_column(cat, justify="right")
    layers.add_column("all", justify="right")
    for i, layer_idx in enumerate(result["moe_layers"]):
        layers.add_row(
            str(i),
            str(layer_idx),
            *[f"{v['per_layer'][i]:.3f}" for v in cats.values()],
            f"{result['overall']['per_layer'][i]:.3f}",
        )
    console.print(layers)
    for figure in result.get("plots", []):
        console.print(f"[dim]wrote {figure}[/dim]")
    write_json(json_path, result)


@app.command("demo")
def demo_cmd(
    family: Annotated[str, typer.Option(help=f"Tiny model family: {', '.join(FAMILIES)}.")] = "olmoe",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens")] = 48,
    out: Annotated[Path, typer.Option(help="Directory for figures.")] = Path("out/demo"),
    json_path: JsonOpt = None,
) -> None:
    """The routing core end to end on a built-in tiny model: inspect, switch rate, mask, Gumbel, pool."""
    from moectl.commands.demo import run_demo

    try:
        result = run_demo(family, max_new_tokens, str(out))
    except (ValueError, OSError) as err:
        fail(err)
    table = Table(title=f"moectl demo on {result['model']}", show_header=False)
    table.add_row("self-test", "PASS" if result["self_test_passed"] else "FAIL")
    for name, value in result["switch_rate"].items():
        table.add_row(f"switch rate, {name}", f"{value:.3f}")
    for section in ("mask_half_experts", "gumbel_tau_0.5", "document_pool_causal"):
        for key, value in result[section].items():
            table.add_row(f"{section}: {key}", f"{value:.4f}" if isinstance(value, float) else str(value))
    for figure in result.get("plots", []):
        table.add_row("figure", figure)
    console.print(table)
    write_json(json_path, result)


def _mount() -> None:
    """Verbs that live in their own packages."""
    from moectl.data.cli import corpus_app, tokenizer_app
    from moectl.eval.cli import data_app, eval_command, report_command
    from moectl.options.baselines_cli import baselines_command
    from moectl.options.cli import options_app
    from moectl.pretrain import pretrain_command
    from moectl.roe.cli import roe_app
    from moectl.serve.cli import serve_offload_command
    from moectl.subsets.cli import modularity_cmd, subset_app

    app.add_typer(corpus_app, name="corpus", help="Build the offline multi-domain corpus.")
    app.add_typer(tokenizer_app, name="tokenizer", help="Train moectl's byte-level BPE tokenizer.")
    app.command("pretrain")(pretrain_command)
    app.command("eval")(eval_command)
    app.command("report")(report_command)
    app.command("serve-offload")(serve_offload_command)
    app.add_typer(subset_app, name="subset", help="Select, export and analyse per-domain expert subsets.")
    app.command("modularity")(modularity_cmd)
    app.add_typer(roe_app, name="roe", help="Roster of Experts: Gumbel-routed ensembles with a clean KV cache.")
    app.add_typer(data_app, name="data", help="Fetch offline evaluation sets.")
    app.add_typer(options_app, name="options", help="Temporally extended MoE: option controllers (TE-MoE).")
    app.command("baselines")(baselines_command)


_mount()


def main() -> None:
    import sys

    if len(sys.argv) > 1 and sys.argv[1] == "pretrain":
        from moectl.train.allocator import reexec_with_fast_allocator

        reexec_with_fast_allocator()  # training steps page-fault under glibc's defaults
    app()


if __name__ == "__main__":
    main()
