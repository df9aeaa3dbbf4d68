"""``moectl serve-offload``: generate with only a budget of experts resident and report the cost.

Mount with ``app.command("serve-offload")(serve_offload_command)``; ``serve_app`` runs it alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

serve_app = typer.Typer(help="Serve an MoE with offloaded experts.", no_args_is_help=True)
console = Console(width=None if Console().is_terminal else 160)


def parse_budget(text: str) -> float | int:
    """``0.25`` (a fraction of the experts per layer) or ``4`` (experts per layer)."""
    try:
        return float(text) if any(c in text for c in ".eE") else int(text)
    except ValueError as err:
        raise typer.BadParameter(
            f"--budget must be a fraction like 0.25 or a count like 4, got {text!r}"
        ) from err


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


@serve_app.command("serve-offload")
def serve_offload_command(
    model: Annotated[
        str | None, typer.Argument(help="Checkpoint directory or hub id (or use --tiny).")
    ] = None,
    tiny: Annotated[str | None, typer.Option("--tiny", help="Tiny random model of a family.")] = None,
    budget: Annotated[
        str, typer.Option(help="Resident experts per MoE layer: a fraction (0.25) or a count (4).")
    ] = "0.25",
    policy: Annotated[str, typer.Option(help="lru | static:SUBSET.json | option:K_HAT | controller:DIR")] = "lru",
    store: Annotated[str, typer.Option(help="Where non-resident experts live: disk | host.")] = "disk",
    store_dir: Annotated[
        Path | None,
        typer.Option("--store-dir", help="Directory for the disk store (default: a temporary one)."),
    ] = None,
    prompts: Annotated[
        Path | None, typer.Option(help="JSONL with 'prompt' per line; default: built-in prompts.")
    ] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens")] = 64,
    plot: Annotated[Path | None, typer.Option(help="PNG (or directory) for the load timeline.")] = None,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Also write the results to this JSON file.")
    ] = None,
    seed: int = 0,
) -> None:
    """Generate greedily with experts offloaded; report memory, loads, bytes moved, time and hit rate."""
    import torch

    from moectl.generate import load_prompts
    from moectl.models.load import load_model
    from moectl.serve.runner import serve_offload, write_json

    if (model is None) == (tiny is None):
        raise typer.BadParameter("give exactly one of MODEL (a checkpoint path or hub id) or --tiny FAMILY")
    if store not in ("disk", "host"):
        raise typer.BadParameter(f"--store must be disk or host, got {store!r}")
    torch.manual_seed(seed)
    try:
        net, tokenizer = load_model(f"tiny:{tiny}" if tiny else str(model), seed=seed)
        if policy.startswith("controller:"):
            from moectl.options.state import load_controlled
            from moectl.serve.policies import ControllerResidency

            folder = Path(policy.split(":", 1)[1])
            folder = folder / "final" if (folder / "final" / "controller.json").exists() else folder
            net, controller, _, _ = load_controlled(net, folder, merge=True)
            net.eval()
            policy = ControllerResidency(controller, seed=seed)
        result = serve_offload(
            net,
            tokenizer,
            load_prompts(prompts),
            parse_budget(budget),
            policy,
            store,
            max_new_tokens,
            store_dir=store_dir,
            plot=plot,
        )
    except (ValueError, OSError, RuntimeError) as err:
        console.print(f"[red]error:[/red] {err}")
        raise typer.Exit(1) from err
    table = Table(title=f"serve-offload: policy {result['policy']}, store {store}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    rows = [
        (
            "resident experts / layer",
            f"{result['budget_experts_per_layer'][0]} of {result['num_experts'][0]}",
        ),
        ("resident expert memory", _mib(result["resident_expert_bytes"])),
        ("total expert memory", _mib(result["total_expert_bytes"])),
        ("non-expert memory", _mib(result["non_expert_bytes"])),
        ("peak process RSS", _mib(result["peak_rss_bytes"])),
        ("loads / generated token", f"{result['loads_per_token']:.3f}"),
        ("bytes moved / generated token", _mib(result["bytes_moved_per_token"])),
        ("hit rate", "-" if result["hit_rate"] is None else f"{result['hit_rate']:.3f}"),
        ("load time", f"{result['load_s']:.3f} s"),
        ("expert compute time", f"{result['expert_compute_s']:.3f} s"),
        ("tokens/s", f"{result['tokens_per_s']:.1f}"),
        ("one expert load (median)", f"{result['load_latency']['load_s'] * 1e6:.1f} µs"),
        ("deliberation cost η", f"{result['eta']['value']:.4f}"),
    ]
    for row in rows:
        table.add_row(*row)
    console.print(table)
    if json_path is not None:
        console.print(f"[dim]wrote {write_json(result, json_path)}[/dim]")
