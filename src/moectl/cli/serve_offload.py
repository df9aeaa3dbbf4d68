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
    ForceOpt,
    JsonOpt,
    MoectlGroup,
    OptionalModelArg,
    QuantizeOpt,
    ThreadsOpt,
    TinyOpt,
    console,
    handle_moectl_errors,
    interrupted,
    model_spec,
    use_threads,
    write_json,
)

serve_app = typer.Typer(cls=MoectlGroup, help="Serve an MoE with offloaded experts.", no_args_is_help=True)


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


def _rate(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}"


def _seconds(s: float | None) -> str:
    return "-" if s is None else f"{s:.3f} s"


@serve_app.command("serve-offload")
@interrupted("nothing was written (results are written when the command finishes); run the command again")
def serve_offload_command(
    model: OptionalModelArg = None,
    tiny: TinyOpt = None,
    budget: Annotated[
        str, typer.Option(help="Resident experts per MoE layer: a fraction (0.25) or a count (4).")
    ] = "0.25",
    policy: Annotated[
        str,
        typer.Option(
            help="lru | s3fifo | arc | reroute:TOL | pregate | static:SUBSET.json | option:K_HAT | controller:DIR, or any policy file or folder "
            "(`moectl.load_policy`: a subset file or expert mask is served static, a controller folder as controller)."
        ),
    ] = "lru",
    store: Annotated[
        str,
        typer.Option(
            help="Where non-resident experts live: disk (a checkpoint folder's own shards, read on demand; "
            "a temporary store for tiny:/shape: models) | checkpoint (the shards, required) | host (RAM)."
        ),
    ] = "disk",
    read_method: Annotated[
        str,
        typer.Option(
            "--read-method",
            help="How checkpoint shards are read: direct (O_DIRECT, the page cache stays empty) | fadvise | plain.",
        ),
    ] = "direct",
    experts_forward: Annotated[
        str,
        typer.Option(
            "--experts-forward",
            help="grouped (one grouped GEMM over the resident slots) | eager (transformers' per-expert loop).",
        ),
    ] = "grouped",
    slot_dtype: Annotated[
        str,
        typer.Option(
            "--slot-dtype",
            help="Resident experts: same (the model's dtype) | int8 (weight-only, per-row scales: half "
            "the memory of bf16, faster reads on CPU, not exact).",
        ),
    ] = "same",
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
    max_batch: Annotated[
        int,
        typer.Option(
            "--max-batch",
            help="Prompts decoded together by the engine (their rows share the resident experts); "
            "1: one at a time.",
        ),
    ] = 1,
    plot: Annotated[Path | None, typer.Option(help="PNG (or directory) for the load timeline.")] = None,
    json_path: JsonOpt = None,
    quantize: QuantizeOpt = None,
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
    load_timeout: Annotated[
        float,
        typer.Option(
            "--load-timeout",
            help="Seconds compute waits for one expert load from the worker thread (--async-loads on CPU) "
            "before stopping with an error naming the expert.",
        ),
    ] = 300.0,
    seed: Annotated[int, typer.Option(help="Seed of a tiny model's weights and of controller sampling.")] = 0,
    routing: Annotated[
        str | None,
        typer.Option(
            help="A routing every prompt is served with beside the residency policy: topk:N (N experts per "
            "token: fewer to load), an expert-mask or policy file, or a policy as JSON ('moectl serve --routing' specs).",
        ),
    ] = None,
    threads: ThreadsOpt = None,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "auto",
    force: ForceOpt = False,
) -> None:
    """Generate greedily with experts offloaded; report memory, loads, bytes moved, time and hit rate."""
    from moectl.offload.int8 import SLOT_DTYPES
    from moectl.offload.offload_config import EXPERTS_FORWARDS, STORES, OffloadConfig
    from moectl.offload.prefetch import PrefetchConfig
    from moectl.routing.made_for import policy_target
    from moectl.server.offload_batch import ServeOffloadConfig, run

    spec = model_spec(model, tiny)
    if store not in STORES:
        raise typer.BadParameter(f"--store must be one of {', '.join(STORES)}, got {store!r}")
    if read_method not in ("direct", "fadvise", "plain"):
        raise typer.BadParameter(f"--read-method must be direct, fadvise or plain, got {read_method!r}")
    if experts_forward not in EXPERTS_FORWARDS:
        raise typer.BadParameter(
            f"--experts-forward must be one of {', '.join(EXPERTS_FORWARDS)}, got {experts_forward!r}"
        )
    if max_batch < 1:
        raise typer.BadParameter(f"--max-batch must be >= 1, got {max_batch}")
    if threads is not None and threads < 1:
        raise typer.BadParameter(f"--threads must be >= 1, got {threads}")
    if slot_dtype not in SLOT_DTYPES:
        raise typer.BadParameter(f"--slot-dtype must be one of {', '.join(SLOT_DTYPES)}, got {slot_dtype!r}")
    n_threads = use_threads(threads)
    with handle_moectl_errors():
        config = ServeOffloadConfig(
            model=spec,
            offload=OffloadConfig(
                budget=parse_budget(budget),
                policy=policy,
                store=store,
                store_dir=store_dir,
                async_loads=async_loads,
                prefetch=prefetch,
                prefetch_config=PrefetchConfig(prefetch_lookahead, prefetch_beta),
                read_method=read_method,
                experts_forward=experts_forward,
                slot_dtype=slot_dtype,
                load_timeout_s=load_timeout,
            ),
            prompts=prompts,
            max_new_tokens=max_new_tokens,
            max_batch=max_batch,
            plot=plot,
            seed=seed,
            device=device,
            dtype=dtype,
            routing=routing,
            quantize=quantize,
        )
    with handle_moectl_errors(), policy_target(spec, force=force):  # serve_app has one command: no MoectlGroup
        result = run(config)
    routed = f", routing {result['routing']}" if result.get("routing") else ""
    table = Table(title=f"serve-offload: policy {result['policy']}{routed}, store {result['store']}")
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
        ("time to first token", _seconds(result["time_to_first_token_s"])),
        (
            "disk bytes read / generated token",
            "-" if result["disk_read_bytes_per_token"] is None else _mib(result["disk_read_bytes_per_token"]),
        ),
        ("loads / generated token", f"{result['loads_per_token']:.3f}"),
        ("bytes moved / generated token", _mib(result["bytes_moved_per_token"])),
        ("hit rate", "-" if result["hit_rate"] is None else f"{result['hit_rate']:.3f}"),
        (
            "switch rate of the resident option",
            f"- ({result['switch_rate_unmeasured']})" if result["switch_rate"] is None else f"{result['switch_rate']:.3f}",
        ),
        ("loader", f"{result['loader']}" + (", prefetch" if result["prefetch"] else "")),
        ("load time (of which compute waited)", f"{result['load_s']:.3f} s ({result['stall_s']:.3f} s)"),
        (
            "prefetch hits / loads",
            f"{result['prefetch_hits']} / {result['prefetch_loads']}" if result["prefetch"] else "-",
        ),
        ("expert compute time", f"{result['expert_compute_s']:.3f} s"),
        ("tokens/s (decode only)", f"{result['tokens_per_s']:.2f} ({_rate(result['decode_tokens_per_s'])})"),
        ("prompts decoded together (max batch)", str(result["max_batch"])),
        ("torch threads", str(n_threads)),
        ("one expert load (median)", f"{result['load_latency']['load_s'] * 1e6:.1f} µs"),
        ("deliberation cost η", f"{result['eta']['value']:.4f}"),
    ]
    rows.append(("load timeline (PNG)", result.get("plot") or "not written (--plot PATH writes it)"))
    for row in rows:
        table.add_row(*row)
    console.print(table)
    write_json(json_path, {**result, "threads": n_threads})
