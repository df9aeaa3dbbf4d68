"""``moectl serve-offload``: generate with only a budget of experts resident and report the cost.

``serve_app`` runs it alone (``moectl.cli`` mounts ``serve_offload_command`` as ``serve-offload``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from moectl.cli.common import (
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    OptionalModelArg,
    TinyOpt,
    console,
    fail,
    load,
    model_spec,
    write_json,
)

serve_app = typer.Typer(help="Serve an MoE with offloaded experts.", no_args_is_help=True)


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
    model: OptionalModelArg = None,
    tiny: TinyOpt = None,
    budget: Annotated[
        str, typer.Option(help="Resident experts per MoE layer: a fraction (0.25) or a count (4).")
    ] = "0.25",
    policy: Annotated[
        str,
        typer.Option(
            help="lru | static:SUBSET.json | option:K_HAT | controller:DIR, or any policy file or folder "
            "(`moectl.load_policy`: a subset file or expert mask is served static, a controller folder as controller)."
        ),
    ] = "lru",
    store: Annotated[str, typer.Option(help="Where non-resident experts live: disk | host.")] = "disk",
    store_dir: Annotated[
        Path | None,
        typer.Option("--store-dir", help="Directory for the disk store (default: a temporary one)."),
    ] = None,
    prompts: Annotated[
        Path | None, typer.Option(help="JSONL with 'prompt' per line; default: built-in prompts.")
    ] = None,
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", help="Tokens generated per prompt.")
    ] = 64,
    plot: Annotated[Path | None, typer.Option(help="PNG (or directory) for the load timeline.")] = None,
    json_path: JsonOpt = None,
    async_loads: Annotated[
        bool | None,
        typer.Option(
            "--async-loads/--no-async-loads",
            help="Overlap expert loads with compute (CUDA: a side stream; CPU: a worker thread). "
            "Default: on with CUDA, off without.",
        ),
    ] = None,
    prefetch: Annotated[
        bool | None,
        typer.Option(
            "--prefetch/--no-prefetch",
            help="Start loading a predicted switch's experts one token early (option and controller "
            "policies; only into free or unpinned slots). Default: as --async-loads.",
        ),
    ] = None,
    prefetch_lookahead: Annotated[
        int,
        typer.Option(
            help="option policy: a runner-up within top-k + this many ranks, outside the option, "
            "predicts a switch."
        ),
    ] = 1,
    prefetch_beta: Annotated[
        float, typer.Option(help="controller policy: β above this predicts a switch.")
    ] = 0.5,
    seed: Annotated[int, typer.Option(help="Seed of a tiny model's weights and of controller sampling.")] = 0,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "auto",
) -> None:
    """Generate greedily with experts offloaded; report memory, loads, bytes moved, time and hit rate."""
    import torch

    from moectl.generate import load_prompts
    from moectl.serve.policies import ControllerResidency, parse_policy
    from moectl.serve.prefetch import PrefetchConfig
    from moectl.serve.runner import serve_offload

    spec = model_spec(model, tiny)
    if store not in ("disk", "host"):
        raise typer.BadParameter(f"--store must be disk or host, got {store!r}")
    torch.manual_seed(seed)
    try:
        prefetch_config = PrefetchConfig(prefetch_lookahead, prefetch_beta)
        net, tokenizer = load(spec, device, dtype, seed=seed)
        residency = parse_policy(policy, net)  # a controller's adapters and routers merge into net
        if isinstance(residency, ControllerResidency):
            residency = ControllerResidency(residency.route_policy, seed=seed)
        result = serve_offload(
            net,
            tokenizer,
            load_prompts(prompts),
            parse_budget(budget),
            residency,
            store,
            max_new_tokens,
            store_dir=store_dir,
            plot=plot,
            async_loads=async_loads,
            prefetch=prefetch,
            prefetch_config=prefetch_config,
        )
    except (ValueError, OSError, RuntimeError) as err:
        fail(err)
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
        ("loader", f"{result['loader']}" + (", prefetch" if result["prefetch"] else "")),
        ("load time (of which compute waited)", f"{result['load_s']:.3f} s ({result['stall_s']:.3f} s)"),
        (
            "prefetch hits / loads",
            f"{result['prefetch_hits']} / {result['prefetch_loads']}" if result["prefetch"] else "-",
        ),
        ("expert compute time", f"{result['expert_compute_s']:.3f} s"),
        ("tokens/s", f"{result['tokens_per_s']:.1f}"),
        ("one expert load (median)", f"{result['load_latency']['load_s'] * 1e6:.1f} µs"),
        ("deliberation cost η", f"{result['eta']['value']:.4f}"),
    ]
    for row in rows:
        table.add_row(*row)
    console.print(table)
    write_json(json_path, result)
