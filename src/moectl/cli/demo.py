"""``moectl demo``: the routing core end to end on a built-in tiny model, in seconds."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from moectl.cli.common import (
    FAMILY_HELP,
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    check_out_folder,
    console,
    load,
    write_json,
)


def demo_cmd(
    family: Annotated[str, typer.Option(help=f"Tiny model family: {FAMILY_HELP}.")] = "olmoe",
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", help="Tokens generated per prompt.")
    ] = 48,
    out: Annotated[Path, typer.Option(help="Directory for figures.", callback=check_out_folder)] = Path(
        "out/demo"
    ),
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "auto",
    json_path: JsonOpt = None,
) -> None:
    """The routing core end to end on a built-in tiny model: inspect, switch rate, mask, Gumbel, pool."""
    from moectl.demo import run_demo
    from moectl.extras import message, missing_modules

    spec = f"tiny:{family}"
    drawn = not missing_modules("plots")  # the core install runs the demo; its figures need matplotlib
    model, tokenizer = load(spec, device, dtype)
    result = run_demo(model, tokenizer, spec, max_new_tokens, str(out) if drawn else None)
    table = Table(title=f"moectl demo on {result['model']}", show_header=False)
    table.add_row("self-test", "PASS" if result["self_test_passed"] else "FAIL")
    for name, value in result["switch_rate"].items():
        table.add_row(f"switch rate, {name}", f"{value:.3f}")
    for section in ("mask_half_experts", "gumbel_tau_0.5", "document_pool_causal"):
        for key, value in result[section].items():
            table.add_row(f"{section}: {key}", f"{value:.4f}" if isinstance(value, float) else str(value))
    for figure in result.get("plots", []):
        table.add_row("figure", figure)
    if not drawn:
        table.add_row("figure", escape(message("not drawn: TE-MoE Figure 2", "plots")))
    console.print(table)
    write_json(json_path, result)
