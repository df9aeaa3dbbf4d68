"""``moectl offload simulate``: replay recorded routing through per-layer expert caches, every policy
and budget side by side with the offline optimum (``moectl.residency``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from moectl.cli.common import JsonOpt, MoectlGroup, console, write_json, write_or_fail

offload_app = typer.Typer(cls=MoectlGroup, help="Expert offloading: which experts to keep resident.", no_args_is_help=True)


def _expert_bytes(expert_bytes: int | None, checkpoint: Path | None, layers: int) -> tuple[int, ...] | None:
    """Bytes of one expert per MoE layer: ``--expert-bytes`` for every layer, or a checkpoint's."""
    from moectl.errors import ConfigError

    if expert_bytes is not None and checkpoint is not None:
        raise ConfigError("give --expert-bytes or --checkpoint, not both")
    if expert_bytes is not None:
        if expert_bytes < 1:
            raise ConfigError(f"--expert-bytes must be a positive number of bytes, got {expert_bytes}")
        return (expert_bytes,) * layers
    if checkpoint is None:
        return None
    from moectl.models.meta_model import build_meta, load_config

    per_layer = _meta_expert_bytes(build_meta(load_config(checkpoint)))  # shapes and dtypes, no weights
    if len(per_layer) != layers:
        raise ConfigError(f"--checkpoint {checkpoint} has {len(per_layer)} MoE layers, the trace {layers}")
    return tuple(per_layer)


def _meta_expert_bytes(meta) -> list[int]:
    from moectl.adapters import inspect
    from moectl.offload.int8 import expert_slot_bytes

    out = []
    for layer in inspect(meta).layers:
        params = [
            p
            for p in layer.block.experts.parameters(recurse=False)
            if p.dim() >= 2 and p.shape[0] == layer.num_experts
        ]
        out.append(expert_slot_bytes(params, "same"))
    return out


@offload_app.command("simulate")
def simulate_command(
    traces: Annotated[
        list[Path],
        typer.Argument(
            help="Recorded routing: a moectl trace (RoutingTrace.save / switch-rate --trace: NAME.safetensors "
            "+ NAME.json, or a folder holding one) or an .npy int array \\[tokens, layers, top_k] (vLLM/SGLang "
            "routed_experts). Several are replayed one after another.",
            show_default=False,
        ),
    ],
    num_experts: Annotated[
        int | None,
        typer.Option("--num-experts", help="Experts per MoE layer (required for .npy; checked for traces)."),
    ] = None,
    budget: Annotated[
        str | None,
        typer.Option(help="Resident experts per MoE layer, one or a comma list (default: top-k, 2×, 4×)."),
    ] = None,
    policies: Annotated[
        str,
        typer.Option(
            help="Comma list of lru, lfu, lfuda, arc, s3fifo, least-stale, static (the trace's B - k most used "
            "experts pinned: an oracle), static:FILE (a subset file pinned), belady (the optimum)."
        ),
    ] = "lru,lfu,lfuda,arc,s3fifo,least-stale,static,belady",
    expert_bytes: Annotated[
        int | None, typer.Option("--expert-bytes", help="Bytes of one expert, for bytes loaded per token.")
    ] = None,
    checkpoint: Annotated[
        Path | None,
        typer.Option(help="Checkpoint folder (config.json) to read each layer's expert bytes from."),
    ] = None,
    routing: Annotated[
        str,
        typer.Option(
            help="How the trace's routing came about, shown in the table and JSON (e.g. 'learned: "
            "moectl-small-standard' or 'random weights')."
        ),
    ] = "not stated",
    plot: Annotated[
        Path | None, typer.Option(help="PNG of hit rate against budget (a .png path or a folder).")
    ] = None,
    json_path: JsonOpt = None,
) -> None:
    """Hit rate, misses and bytes per token, and the gap to Belady's optimum, per policy and budget."""
    from moectl.errors import ConfigError
    from moectl.residency.simulate import (
        SimConfig,
        check_budgets,
        parse_budgets,
        parse_policies,
        report,
        run,
    )
    from moectl.residency.trace_input import read_accesses

    names = parse_policies(policies)
    budgets = None if budget is None else parse_budgets(budget)
    if num_experts is not None and num_experts < 1:
        raise ConfigError(f"--num-experts must be at least 1, got {num_experts}")
    acc = read_accesses(list(traces), num_experts, progress=True)  # a bar on a terminal only
    if budgets is None:
        budgets = tuple(sorted({min(m * acc.top_k, acc.num_experts) for m in (1, 2, 4)}))
    check_budgets(budgets, acc.top_k, acc.num_experts)
    config = SimConfig(acc, budgets, names, _expert_bytes(expert_bytes, checkpoint, acc.layers))
    rows = run(config, progress=True)
    doc = report(config, rows, routing)
    if plot is not None:
        from moectl.reporting.residency_plots import plot_hit_rate

        title = (
            f"hit rate vs budget: {acc.tokens} tokens × {acc.layers} layers × top-{acc.top_k} of "
            f"{acc.num_experts}\nrouting: {routing}"
        )
        doc["plot"] = str(write_or_fail("--plot", plot_hit_rate, rows, plot, title))
    overlap = doc["trace"]["previous_token_overlap"]
    table = Table(
        title=f"offload simulate: {acc.tokens} tokens × {acc.layers} layers × top-{acc.top_k} of "
        f"{acc.num_experts} experts ({acc.accesses} accesses); routing: {routing}"
        + ("" if overlap is None else f"; experts shared with the previous token: {overlap:.1%}")
    )
    for col in ("policy", "budget", "hit rate", "misses/token", "MiB/token", "gap to belady", "time"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in rows:
        mib = "-" if r["bytes_per_token"] is None else f"{r['bytes_per_token'] / 2**20:.3f}"
        table.add_row(
            r["policy"],
            str(r["budget"]),
            f"{r['hit_rate']:.4f}",
            f"{r['misses_per_token']:.2f}",
            mib,
            f"{100 * r['gap_to_belady']:.2f} pp",
            f"{r['seconds']:.2f} s",
        )
    console.print(table)
    if "plot" in doc:
        console.print(f"[dim]wrote {doc['plot']}[/dim]")
    write_json(json_path, doc)
