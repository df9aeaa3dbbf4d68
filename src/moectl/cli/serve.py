"""``moectl serve MODEL``: an OpenAI-compatible HTTP server (``moectl.server``) over the batching engine.

The command only parses its flags into a :class:`moectl.server.ServeConfig` (whose checks refuse a
bad value in one line, exit 2) and calls :func:`moectl.server.run_serve`, as a Python user would.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from moectl.cli.common import (
    DeviceOpt,
    DtypeOpt,
    ForceOpt,
    OptionalModelArg,
    QuantizeOpt,
    ThreadsOpt,
    TinyOpt,
    console,
    fail,
    model_spec,
)
from moectl.server.serve_config import LOG_LEVELS, served_name

if TYPE_CHECKING:
    from moectl.offload.offload_config import OffloadConfig

__all__ = ["parse_routings", "parse_tokens", "serve_command", "served_name"]  # served_name: the library's, re-exported

ROUTING = re.compile(r"^([^=]+)=(.+)$")
TOKENS = re.compile(r"^(\d+(?:\.\d+)?)([kmgKMG]?)$")  # vLLM's human-readable lengths: 1k = 1000, 1K = 1024
SCALES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


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


def parse_tokens(flag: str, value: str | None, rest: bool = False) -> int | None:
    """A number of tokens as vLLM's ``--max-model-len`` takes it (``4096``, ``4k`` = 4000, ``4K`` =
    4096); ``rest``: ``-1`` is accepted too (the rest of the context). ``ConfigError`` in one line
    naming the flag; None stays None (the flag not given)."""
    from moectl.errors import ConfigError

    if value is None:
        return None
    text = value.strip()
    if rest and text == "-1":
        return -1
    match = TOKENS.match(text)
    amount = float(match.group(1)) * SCALES[match.group(2)] if match else None
    if amount is None or amount != int(amount):
        allowed = "a whole number of tokens like 4096 or 4k (1000s) or 4K (1024s)" + (
            ", or -1 for the rest of the context" if rest else ""
        )
        raise ConfigError(f"{flag} must be {allowed}; got {value!r}")
    return int(amount)


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
            'policy file, a policy inline as JSON (g=\'{"type": "gumbel", "tau": 0.5}\'), option:K (the model\'s '
            "routing; switch_rate at k-hat = K), controller:DIR (`moectl.load_policy`), or a RoE profile "
            "(`moectl roe tune --out`). No routing: the model as trained.",
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
    max_model_len: Annotated[
        str | None,
        typer.Option(
            "--max-model-len",
            metavar="N",
            help="Tokens a request may hold, prompt + max_tokens (vLLM's flag; 4096, or 4k = 4000, 4K = 4096): "
            "past it a 400 names the numbers. Default: the model's max_position_embeddings, which it may "
            "not pass.",
        ),
    ] = None,
    default_max_tokens: Annotated[
        str | None,
        typer.Option(
            "--default-max-tokens",
            metavar="N",
            help="max_tokens of a request that gives none, on completions and chat alike, cut to the room "
            "the prompt leaves (-1: the rest of the context, as llama-server's --n-predict -1). Default: "
            "OpenAI's and vLLM's, 16 for /v1/completions and the rest of the context for chat.",
        ),
    ] = None,
    chat_template: Annotated[
        str | None,
        typer.Option(
            "--chat-template",
            metavar="FILE|TEMPLATE",
            help="A file holding a Jinja chat template, or the template itself (vLLM's flag), used for "
            "/v1/chat/completions and /tokenize instead of the tokenizer's own.",
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
    lean_decode: Annotated[
        bool,
        typer.Option(
            "--lean-decode/--no-lean-decode",
            help="Decode through moectl's lean forward where the model's family has one (OLMoE, "
            "Qwen2-MoE, Qwen3-MoE, Mixtral: the same numbers without transformers' per-layer plumbing); "
            "--no-lean-decode: the model's own forward. /metrics counts each (moectl_decode_forwards).",
        ),
    ] = True,
    compile_decode: Annotated[
        bool | None,
        typer.Option(
            "--compile/--no-compile",
            help="Decode through one compiled step (torch.compile; OLMoE, Qwen2-MoE, Qwen3-MoE, Mixtral) "
            "where a step's rows are routed as the model routes them and nothing records it; other steps "
            "take the lean forward (/metrics: moectl_decode_slow_steps says why). Compiled at start "
            "(about a minute). Default: on, off for tiny: test models.",
        ),
    ] = None,
    cuda_graphs: Annotated[
        bool | None,
        typer.Option(
            "--cuda-graphs/--no-cuda-graphs",
            help="On a GPU, replay the compiled step as CUDA graphs over static KV buffers (as vLLM and "
            "SGLang do; --no-cuda-graphs: the compiled step without them). Default: on with --compile on CUDA. "
            "Never run on a GPU yet (docs/gpu.md).",
        ),
    ] = None,
    cuda_graph_columns: Annotated[
        int,
        typer.Option(
            "--cuda-graph-columns",
            metavar="TOKENS",
            help="The longest cache the CUDA graphs' static buffers hold (capped at the model's context); "
            "longer requests decode without graphs (/metrics: moectl_decode_slow_steps says why).",
        ),
    ] = 4096,
    return_routed_experts: Annotated[
        bool,
        typer.Option(
            "--enable-return-routed-experts",
            help="Every choice carries routed_experts (vLLM's flag): the experts of each forwarded token "
            "[prompt + completion - 1, MoE layers, top-k], a .npy in base64. Without it a request asks "
            "with return_routed_experts: true.",
        ),
    ] = False,
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
    quantize: QuantizeOpt = None,
    force: ForceOpt = False,
) -> None:
    """Serve MODEL over HTTP with OpenAI's API: /v1/models, /v1/completions, /v1/chat/completions
    (stream: true as server-sent events), /health, /metrics (Prometheus). SIGTERM drains and exits 0;
    requests still running after --shutdown-timeout end with finish_reason "abort"."""
    try:
        spec = model_spec(model, tiny)
    except typer.BadParameter as err:
        fail(str(err))
    from moectl.routing.made_for import policy_target
    from moectl.server.serve_config import ServeConfig
    from moectl.server.serve_run import run_serve

    config = ServeConfig(
        model=spec,
        host=host,
        port=port,
        served_model_names=served_model_name,
        routings=parse_routings(routing or []),
        default_routing=default_routing,
        max_batch=max_batch,
        max_queue=max_queue,
        prefix_cache=prefix_cache,
        prefill_chunk=prefill_chunk,
        lean_decode=lean_decode,
        compile_decode=compile_decode,
        cuda_graphs=cuda_graphs,
        cuda_graph_columns=cuda_graph_columns,
        return_routed_experts=return_routed_experts,
        max_model_len=parse_tokens("--max-model-len", max_model_len),
        default_max_tokens=parse_tokens("--default-max-tokens", default_max_tokens, rest=True),
        chat_template=chat_template,
        api_key=api_key,
        offload=_offload_config(budget, residency, slot_dtype, store),
        tokenizer=tokenizer_path,
        read_timeout=read_timeout,
        timeout_keep_alive=timeout_keep_alive,
        shutdown_timeout=shutdown_timeout,
        seed=seed,
        log_level=log_level,
        threads=threads,
        device=device,
        dtype=dtype,
        quantize=quantize,
    )
    try:
        with policy_target(spec, force=force):  # --routing files made for another model: refused unless --force
            run_serve(config, announce=_announce)
    except (ValueError, OSError, RuntimeError, MemoryError) as err:  # loading the model, binding the port
        fail(err)


def _announce(line: str) -> None:
    """``run_serve``'s lines on the console, a ``warning:`` in yellow."""
    if line.startswith("warning:"):
        console.print(f"[yellow]warning:[/yellow]{escape(line.removeprefix('warning:'))}")
    else:
        console.print(escape(line))


def _offload_config(
    budget: str | None, residency: str | None, slot_dtype: str | None, store: str | None
) -> OffloadConfig | None:
    """The offload settings of the four flags, or None when --budget is not given (the others need
    it); refused in the flags' words (``--store``, not OffloadConfig's ``store``)."""
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
