"""``moectl serve MODEL``: an OpenAI-compatible HTTP server (``moectl.server``) over the batching engine."""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Annotated

import typer

from moectl.cli.common import (
    DeviceOpt,
    DtypeOpt,
    OptionalModelArg,
    ThreadsOpt,
    TinyOpt,
    console,
    fail,
    load,
    model_spec,
    use_threads,
)

ROUTING = re.compile(r"^([^=]+)=(.+)$")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def parse_routings(items: list[str]) -> dict[str, str]:
    """``NAME=SPEC`` items as a dict; ``ConfigError`` for a malformed or repeated name."""
    from moectl.errors import ConfigError

    out: dict[str, str] = {}
    for item in items:
        match = ROUTING.match(item)
        if not match:
            raise ConfigError(
                f"--routing {item!r}: give NAME=SPEC, e.g. math=math.subset.json, opt8=option:8 or "
                "ctl=controller:DIR"
            )
        name, spec = match.group(1).strip(), match.group(2).strip()
        if name in out:
            raise ConfigError(f"--routing {name!r} is given twice: one spec per name")
        out[name] = spec
    return out


def served_name(spec: str) -> str:
    """The name /v1/models lists: a checkpoint folder's basename, else the spec itself."""
    path = Path(spec).expanduser()
    return path.resolve().name if path.exists() else spec


def check_port(host: str, port: int) -> None:
    """Refuse a port that cannot be bound before the model loads (``ConfigError`` for a bad port or
    host, ``UnavailableError``, an ``OSError``, for one in use)."""
    from moectl.errors import ConfigError, UnavailableError

    if not 1 <= port <= 65535:
        raise ConfigError(f"--port must be in 1..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise ConfigError(f"--host {host!r} is not an address this machine can bind: {err.strerror}") from err
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as err:
            raise UnavailableError(
                f"cannot listen on {host}:{port}: {err.strerror} (choose another --port)"
            ) from err


def serve_command(
    model: OptionalModelArg = None,
    tiny: TinyOpt = None,
    host: Annotated[str, typer.Option(help="Address to listen on; loopback by default.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    served_model_name: Annotated[
        list[str] | None,
        typer.Option(
            "--served-model-name",
            help="The name clients give as model (repeatable: each is accepted, the first is reported), "
            "as vLLM's flag; default: a checkpoint folder's name, else MODEL as given.",
        ),
    ] = None,
    routing: Annotated[
        list[str] | None,
        typer.Option(
            "--routing",
            help='NAME=SPEC (repeatable): a routing requests may name with "routing": NAME — a subset or '
            'policy file (Gumbel noise: {"type": "gumbel", "tau": 0.5}), option:K, controller:DIR '
            "(`moectl.load_policy`), or a RoE profile (`moectl roe tune --out`). No routing: the model as trained.",
        ),
    ] = None,
    default_routing: Annotated[
        str | None,
        typer.Option(
            "--default-routing",
            help="A registered routing NAME for requests that name none (clients that cannot send the "
            "routing field, e.g. lm-eval's local-completions); unset: the model as trained.",
        ),
    ] = None,
    max_batch: Annotated[int, typer.Option("--max-batch", help="Sequences generated together.")] = 8,
    max_queue: Annotated[
        int, typer.Option("--max-queue", help="Requests waiting for a row; past it requests get 429.")
    ] = 64,
    prefix_cache: Annotated[
        int,
        typer.Option(
            "--prefix-cache",
            help="Prompt tokens whose KV cache is kept, so a prompt that starts as an earlier one prefills "
            "only the rest (routings without per-request state; 0: off).",
        ),
    ] = 2048,
    prefill_chunk: Annotated[
        int,
        typer.Option(
            "--prefill-chunk",
            help="Prompts longer than this many tokens are prefilled a chunk per step, between the running "
            "requests' decoding steps.",
        ),
    ] = 512,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key", envvar="MOECTL_API_KEY", help="Require Authorization: Bearer KEY (all but /health)."
        ),
    ] = None,
    budget: Annotated[
        str | None,
        typer.Option(
            help="Offload experts: resident experts per MoE layer, a fraction (0.25) or a count (4)."
        ),
    ] = None,
    residency: Annotated[
        str | None,
        typer.Option(help="With --budget: lru | option:K | controller:DIR (which experts stay resident)."),
    ] = None,
    slot_dtype: Annotated[
        str | None,
        typer.Option("--slot-dtype", help="With --budget: same | int8 (resident experts' weights)."),
    ] = None,
    store: Annotated[
        str | None, typer.Option(help="With --budget: disk | checkpoint | host (where other experts live).")
    ] = None,
    tokenizer_path: Annotated[
        str | None,
        typer.Option(
            "--tokenizer",
            help="Tokenizer folder or hub id to use instead of MODEL's own (a shape checkpoint's byte "
            "tokenizer, e.g. the one its GGUF export carries).",
        ),
    ] = None,
    read_timeout: Annotated[
        float,
        typer.Option(
            "--read-timeout",
            help="Seconds a client has to send a whole request, from connecting or from its previous "
            "response; then the connection is closed (a request being answered is never cut).",
        ),
    ] = 30.0,
    timeout_keep_alive: Annotated[
        float, typer.Option("--timeout-keep-alive", help="Seconds an idle keep-alive connection is kept.")
    ] = 5.0,
    shutdown_timeout: Annotated[
        float,
        typer.Option(
            "--shutdown-timeout",
            help="Seconds SIGTERM waits for running requests; then they finish with finish_reason "
            '"abort" and the server exits.',
        ),
    ] = 30.0,
    seed: Annotated[int, typer.Option(help="Seed of a tiny model's weights.")] = 0,
    log_level: Annotated[str, typer.Option("--log-level", help=", ".join(LOG_LEVELS))] = "info",
    threads: ThreadsOpt = None,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "auto",
) -> None:
    """Serve MODEL over HTTP with OpenAI's API: /v1/models, /v1/completions, /v1/chat/completions
    (stream: true as server-sent events), /health, /metrics (Prometheus). SIGTERM drains and exits 0;
    requests still running after --shutdown-timeout end with finish_reason "abort"."""
    try:
        spec = model_spec(model, tiny)
    except typer.BadParameter as err:
        fail(str(err))
    from moectl.errors import ConfigError

    routings = parse_routings(routing or [])
    if default_routing is not None and default_routing not in routings:
        names = ", ".join(sorted(routings)) or "none"
        raise ConfigError(f"--default-routing {default_routing!r} is not a --routing NAME; registered: {names}")
    if max_batch < 1:
        raise ConfigError(f"--max-batch must be at least 1, got {max_batch}")
    if max_queue < 1:
        raise ConfigError(f"--max-queue must be at least 1, got {max_queue}")
    if prefill_chunk < 1:
        raise ConfigError(f"--prefill-chunk must be a number of tokens >= 1, got {prefill_chunk}")
    if prefix_cache < 0:
        raise ConfigError(f"--prefix-cache must be a number of tokens >= 0, got {prefix_cache}")
    if threads is not None and threads < 1:
        raise ConfigError(f"--threads must be at least 1, got {threads}")
    if served_model_name is not None and not all(n.strip() for n in served_model_name):
        raise ConfigError("--served-model-name must not be empty")
    if log_level not in LOG_LEVELS:
        raise ConfigError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {log_level!r}")
    offload = _offload_config(budget, residency, slot_dtype, store)
    from moectl.server.uvicorn_run import ServeLimits, serve

    limits = ServeLimits(read_timeout, timeout_keep_alive, shutdown_timeout)
    check_port(host, port)

    from moectl.engine import Engine, EngineConfig
    from moectl.server.app import create_app

    n_threads = use_threads(threads)
    # Everything but the engine's loop thread runs torch with one thread: once OpenMP has a pool of
    # several threads in two threads (the model loaded here, then the loop), the loop's products ran
    # 20-30% slower (OLMoE width, 4 layers, 2 cores: 1 client 16.8-19.0 -> 21.6-22.2 tok/s, 8 clients
    # 41.6-46.7 -> 58.7-59.7, benchmarks/serve_load.py). The loop sets its own count (EngineConfig.threads).
    import torch

    torch.set_num_threads(1)
    reader = None
    try:
        if offload is not None:  # a checkpoint's experts stay in its shards (moectl.offload.loading)
            from moectl.offload.loading import load_for_offload

            net, tokenizer, reader = load_for_offload(spec, offload, dtype, device, seed)
        else:
            net, tokenizer = load(spec, device, dtype, seed=seed)
        if tokenizer_path is not None:
            from moectl.models.load import tokenizer_for

            tokenizer = tokenizer_for(tokenizer_path, int(net.config.vocab_size))
        engine = Engine(
            net,
            tokenizer,
            EngineConfig(
                max_batch=max_batch,
                max_queue=max_queue,
                offload=offload,
                adapt_threads=threads is None,
                prefix_cache_tokens=prefix_cache,
                prefill_chunk=prefill_chunk,
                threads=n_threads,
            ),
            routings=routings,
            reader=reader,
        )
        engine.open()  # the routing and the offload runtime installed now: their errors are one line here
    except (ValueError, OSError, RuntimeError, MemoryError) as err:
        fail(err)
    served = list(served_model_name or [served_name(spec)])
    name = served[0]
    app = create_app(engine, served, api_key=api_key, default_routing=default_routing)
    names = ", ".join(sorted(routings)) or "none"
    default = f", default {default_routing}" if default_routing else ""
    console.print(
        f"serving {name} on http://{host}:{port}/v1 (routings: {names}{default}; {n_threads} torch threads)"
    )
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        console.print(
            f"[yellow]warning:[/yellow] listening on {host} without --api-key: anyone who reaches it may use it"
        )
    try:
        serve(app, host, port, log_level=log_level, limits=limits, on_deadline=engine.abort)
    except OSError as err:
        fail(err)
    finally:
        if reader is not None:
            reader.close()


def _offload_config(budget: str | None, residency: str | None, slot_dtype: str | None, store: str | None):
    """The offload settings, or None when --budget is not given (the others need it)."""
    from moectl.errors import ConfigError

    if budget is None:
        given = [
            f"--{n}" for n, v in (("residency", residency), ("slot-dtype", slot_dtype), ("store", store)) if v
        ]
        if given:
            raise ConfigError(f"{', '.join(given)} only apply with --budget (offloaded experts)")
        return None
    from moectl.offload.int8 import SLOT_DTYPES
    from moectl.offload.offload_config import STORES, OffloadConfig

    if store is not None and store not in STORES:
        raise ConfigError(f"--store must be one of {', '.join(STORES)}, got {store!r}")
    if slot_dtype is not None and slot_dtype not in SLOT_DTYPES:
        raise ConfigError(f"--slot-dtype must be one of {', '.join(SLOT_DTYPES)}, got {slot_dtype!r}")
    try:
        amount = float(budget) if any(c in budget for c in ".eE") else int(budget)
    except ValueError as err:
        raise ConfigError(f"--budget must be a fraction like 0.25 or a count like 4, got {budget!r}") from err
    return OffloadConfig(
        budget=amount, policy=residency or "lru", slot_dtype=slot_dtype or "same", store=store or "disk"
    )
