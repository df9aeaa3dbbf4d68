"""``moectl serve`` as a function: :func:`run_serve` of a :class:`~moectl.server.serve_config.ServeConfig`.

The steps, in the order that makes a mistake cheap: the config's own checks (when it was made),
the port (refused before the model loads, which can take minutes), the model and its tokenizer,
the engine with its routings and offload runtime opened (their errors raised here, before the
server answers anything), then uvicorn until SIGTERM (``uvicorn_run.py``: in-flight requests
finished, those still running at ``shutdown_timeout`` aborted, exit 0).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from moectl.errors import ConfigError, UnavailableError
from moectl.extras import require
from moectl.server.serve_config import ServeConfig

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def check_port(host: str, port: int) -> None:
    """Refuse a port that cannot be bound before the model loads (``ConfigError`` for a bad port or
    host, ``UnavailableError``, an ``OSError``, for one in use)."""
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


def open_engine(config: ServeConfig, threads: int) -> tuple[Any, Any]:
    """``(engine, reader)``: the model loaded (a checkpoint's experts left in its shards under an
    offload budget: ``offload/loading.py``; ``reader`` their shard reader, else None) and the engine
    opened, so a routing or offload runtime that cannot be installed fails here, in one line.
    The reader is closed if anything after loading fails; else the caller closes it."""
    import torch

    from moectl.engine import Engine, EngineConfig

    # Everything but the engine's loop thread runs torch with one thread: once OpenMP has a pool of
    # several threads in two threads (the model loaded here, then the loop), the loop's products ran
    # 20-30% slower (OLMoE width, 4 layers, 2 cores: 1 client 16.8-19.0 -> 21.6-22.2 tok/s, 8 clients
    # 41.6-46.7 -> 58.7-59.7, benchmarks/serve_load.py). The loop sets its own count (EngineConfig.threads).
    torch.set_num_threads(1)
    reader = None
    if config.offload is not None:
        from moectl.offload.loading import load_for_offload

        net, tokenizer, reader = load_for_offload(
            config.model, config.offload, config.dtype, config.device, config.seed, config.quantize
        )
        if config.quantize is not None:  # before the offload runtime installs: its store holds them quantized
            from moectl.loaded import quantize_loaded

            try:
                quantize_loaded(net, config.quantize, merge_first=config.routings.values())
            except BaseException:
                if reader is not None:
                    reader.close()
                raise
    else:
        net, tokenizer = _load(config)
    try:
        if config.tokenizer is not None:
            from moectl.models.load import tokenizer_for

            tokenizer = tokenizer_for(config.tokenizer, int(net.config.vocab_size))
        engine = Engine(
            net,
            tokenizer,
            EngineConfig(
                max_batch=config.max_batch,
                max_queue=config.max_queue,
                offload=config.offload,
                adapt_threads=config.threads is None,
                prefix_cache_tokens=config.prefix_cache,
                prefill_chunk=config.prefill_chunk,
                lean_decode=config.lean_decode,
                compile_decode=config.compile_decode if config.compile_decode is not None
                else not str(config.model).startswith("tiny:"),
                graph_decode=config.cuda_graphs,
                graph_columns=config.cuda_graph_columns,
                threads=threads,
            ),
            routings=dict(config.routings),
            reader=reader,
        )
        # the routing and the offload runtime installed now (their errors are one line here); the
        # compiled step's graphs built by the loop thread (``Engine.start``), not this one
        engine.open(warm_up=False)
    except BaseException:
        if reader is not None:
            reader.close()
        raise
    return engine, reader


def _load(config: ServeConfig) -> tuple[Any, Any]:
    """The model and tokenizer, on this process's own GPU under ``accelerate launch`` (as every verb)."""
    from moectl.distributed import launched_world_size
    from moectl.models.load import load_model

    device = config.device
    if launched_world_size() > 1:
        from moectl.distributed import process_device, ranks

        device = process_device(device, ranks())
    model, tokenizer = load_model(config.model, dtype=config.dtype, device=device, seed=config.seed)
    if config.quantize is not None:  # a controller routing's adapters merge first, into the unquantized weights
        from moectl.loaded import quantize_loaded

        quantize_loaded(model, config.quantize, merge_first=config.routings.values())
    return model, tokenizer


def run_serve(config: ServeConfig, *, announce: Callable[[str], None] = print) -> None:
    """Serve ``config.model`` over HTTP until SIGTERM or SIGINT (then drain and return).

    ``announce`` receives the lines a user should see once the server is up: where it listens,
    and a line starting ``warning:`` when it listens beyond loopback without an API key. Raises
    :class:`moectl.errors.MoectlError` for what the config asks that cannot be done (a port in
    use, a routing that does not load); loading a model may also raise the built-in ``OSError``
    or ``ValueError`` of transformers or the hub.
    """
    require("serve", "moectl.server.run_serve")  # before a model loads
    from moectl.server.app import create_app
    from moectl.server.uvicorn_run import serve
    from moectl.threads import pick_threads

    limits = config.limits()
    check_port(config.host, config.port)
    threads = pick_threads(config.threads)
    engine, reader = open_engine(config, threads)
    try:
        served = config.names()
        app = create_app(
            engine,
            served,
            api_key=config.api_key,
            default_routing=config.default_routing,
            return_routed_experts=config.return_routed_experts,
            max_model_len=config.max_model_len,
            default_max_tokens=config.default_max_tokens,
            chat_template=config.template_text(),
        )
        names = ", ".join(sorted(config.routings)) or "none"
        default = f", default {config.default_routing}" if config.default_routing else ""
        announce(
            f"serving {served[0]} on http://{config.host}:{config.port}/v1 "
            f"(routings: {names}{default}; max model len {engine.max_context}; {threads} torch threads)"
        )
        if config.host not in LOOPBACK and not config.api_key:
            announce(
                f"warning: listening on {config.host} without --api-key: anyone who reaches it may use it"
            )
        serve(
            app, config.host, config.port, log_level=config.log_level, limits=limits, on_deadline=engine.abort
        )
    finally:
        if reader is not None:
            reader.close()
