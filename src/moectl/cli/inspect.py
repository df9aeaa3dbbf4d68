"""``moectl inspect``: family, MoE layers, experts, top-k, shared experts, router rule, self-test."""

from __future__ import annotations

import typer
from rich.table import Table

from moectl.cli.common import (
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    OptionalModelArg,
    TinyOpt,
    console,
    load,
    model_spec,
    write_json,
)

_ROWS = ("family", "router_class", "router_rule", "num_layers", "moe_layers", "dense_layers", "num_experts",
         "top_k", "shared_experts", "parameters")  # fmt: skip


def inspect_cmd(
    model: OptionalModelArg = None,
    tiny: TinyOpt = None,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "auto",
    json_path: JsonOpt = None,
) -> None:
    """Family, MoE layers, experts per layer, top-k, shared experts, router rule, adapter self-test."""
    from moectl.reports import inspect_report

    spec = model_spec(model, tiny)
    lm, _ = load(spec, device, dtype, with_tokenizer=False)
    info = inspect_report(lm, spec)
    table = Table(title=f"moectl inspect {info['model']}", show_header=False)
    for key in _ROWS:
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
