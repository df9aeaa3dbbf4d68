"""``moectl switch-rate``: generate, record routing, report switch rates by prompt category (TE-MoE Table 1)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from moectl.cli.common import (
    DeviceOpt,
    DtypeOpt,
    ForceOpt,
    JsonOpt,
    OptionalModelArg,
    QuantizeOpt,
    TinyOpt,
    check_out_file,
    check_out_folder,
    console,
    interrupted,
    load,
    model_spec,
    write_json,
)


@interrupted("nothing was written (results are written when the command finishes); run the command again")
def switch_rate_cmd(
    model: OptionalModelArg = None,
    tiny: TinyOpt = None,
    prompts: Annotated[
        Path | None, typer.Option(help="JSONL with 'prompt' (and 'category'); default: built-in.")
    ] = None,
    k_hat: Annotated[
        int | None, typer.Option("--k-hat", help="Experts an option keeps (default: top-k).")
    ] = None,
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", help="Tokens generated per prompt.")
    ] = 256,
    temperature: Annotated[float, typer.Option(help="Sampling temperature (0: greedy).")] = 0.5,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Prompts per generate call.")] = 8,
    seed: Annotated[int, typer.Option(help="Seed of sampling (and a tiny model's weights).")] = 0,
    plot: Annotated[
        Path | None,
        typer.Option(help="Directory for the PNG figures (TE-MoE Figure 2).", callback=check_out_folder),
    ] = None,
    trace: Annotated[
        Path | None,
        typer.Option(help="Save the routing trace here (.safetensors + .json).", callback=check_out_file),
    ] = None,
    policy: Annotated[
        str | None,
        typer.Option(
            help="Generate under a policy: a policy file or folder (subset, mask, controller run, ...) or "
            "option:K_HAT; a controller's (or full mask's) recorded mask is ω."
        ),
    ] = None,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "auto",
    quantize: QuantizeOpt = None,
    force: ForceOpt = False,
    json_path: JsonOpt = None,
) -> None:
    """Generate, record routing and report the switch rate (TE-MoE §2.2, Table 1) per layer and category."""
    from moectl.reports import switch_rate_report
    from moectl.routing.made_for import policy_target

    spec = model_spec(model, tiny)
    with policy_target(spec, force=force):  # a --policy made for another model: refused unless --force
        lm, tokenizer = load(spec, device, dtype, seed=seed, quantize=quantize, merge_first=[policy] if policy else ())
        result = switch_rate_report(
            lm, tokenizer, spec, str(prompts) if prompts else None, k_hat, max_new_tokens, temperature,
            batch_size, seed, str(plot) if plot else None, str(trace) if trace else None, policy=policy,
        )  # fmt: skip
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
    for column in ("MoE layer", "decoder layer"):
        layers.add_column(column)
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
