"""The settings of one ``moectl serve`` run, as one value: what ``run_serve(config)`` serves.

``moectl serve`` only parses its flags into a :class:`ServeConfig` and calls
:func:`moectl.server.run_serve`; a Python user builds the same dataclass (or loads a saved one)
and calls the same function::

    from moectl.server import ServeConfig, run_serve
    run_serve(ServeConfig("tiny:olmoe", port=8001, routings={"opt4": "option:4"}, default_routing="opt4"))

Every check that needs neither a model nor the network is here, in ``__post_init__``, so a bad
value is refused (:class:`moectl.errors.ConfigError`: one line, exit 2 under the CLI) before
anything loads, whether it came from a flag or a file. Its messages name the flag, the spelling a
user of the command line types. What needs the model (a routing's spec, a budget too small for
the policy, a tokenizer's vocabulary) or the machine (the port free) is checked by ``run_serve``.

The API key is a secret: it is never written by :meth:`ServeConfig.save` (nor shown by ``repr``);
give it with ``--api-key`` or ``$MOECTL_API_KEY`` each time the server starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from moectl.errors import ConfigError
from moectl.extras import optional_import
from moectl.offload.offload_config import OffloadConfig
from moectl.quant.quant_config import check_scheme
from moectl.runconfig import RunConfig

if TYPE_CHECKING:
    from moectl.server.uvicorn_run import ServeLimits

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
REST_OF_CONTEXT = -1  # --default-max-tokens -1: the rest of the context (llama-server's n_predict -1)
SECRET_FIELDS = ("api_key",)  # never saved: a config file is shared, copied and committed


def served_name(spec: str) -> str:
    """The name /v1/models lists: a checkpoint folder's basename, else the spec itself."""
    path = Path(spec).expanduser()
    return path.resolve().name if path.exists() else spec


@dataclass
class ServeConfig(RunConfig):
    """One HTTP server: the model, where it listens, the routings requests may name, the engine's
    limits, and (``offload``) experts offloaded under a budget.

    ``model``: ``tiny:FAMILY``, a checkpoint folder or a hub id. ``served_model_names``: the names
    clients give as ``model`` (the first is reported; None: :func:`served_name` of ``model``).
    ``routings``: NAME -> SPEC (a subset or policy file, ``option:K``, ``controller:DIR``, a RoE
    profile) a request names with ``"routing": NAME``; ``default_routing``: the one of requests
    that name none (None: the model as trained). ``max_batch``: sequences generated together;
    ``max_queue``: requests waiting for a row (past it: 429). ``prefix_cache``: prompt tokens whose
    KV is kept for later prompts (0: off); ``prefill_chunk``: longer prompts are prefilled a chunk
    per step. ``lean_decode``: decode through ``moectl.lm.lean_decode`` where it applies.
    ``compile_decode``: decode plain steps through the compiled step (``moectl.lm.compiled_decode``;
    compiled at start; None: on for checkpoints, off for ``tiny:`` test models). ``cuda_graphs``: on
    CUDA, replay the compiled step as CUDA graphs over static KV buffers (``moectl.lm.graph_decode``;
    None: on CUDA with ``compile_decode``; never run on a GPU, docs/gpu.md); ``cuda_graph_columns``:
    the longest cache they hold (longer caches decode lean; the buffers take rows x columns x layers
    of keys and values).
    ``return_routed_experts``: every choice carries ``routed_experts`` (vLLM's
    ``--enable-return-routed-experts``; else only requests that ask). ``max_model_len``: the tokens
    a request may hold, prompt + max_tokens (vLLM's flag; None: the model's
    ``max_position_embeddings``, which it may not pass). ``default_max_tokens``: the max_tokens of a
    request that gives none, on /v1/completions and /v1/chat/completions alike (-1: the rest of the
    context; None: OpenAI's and vLLM's defaults, 16 for a completion, the rest of the context for a
    chat). ``chat_template``: a file holding a Jinja chat template, or the template itself, used for
    chats instead of the tokenizer's (vLLM's ``--chat-template``; ``chat_template.py``). ``api_key``: required as ``Authorization: Bearer KEY`` on all but /health (never
    saved). ``tokenizer``: a tokenizer folder or hub id instead of the model's own.
    ``read_timeout``, ``timeout_keep_alive``, ``shutdown_timeout``: seconds (``ServeLimits``).
    ``seed``: a tiny model's weights. ``threads``: the engine loop's torch threads (None: the idle
    CPUs, re-picked as load changes). ``device``, ``dtype``: as every verb's. ``quantize``
    (``int8`` | ``int4``): the experts quantized at load (``moectl.quant``; with ``offload`` the store then holds them quantized).
    """

    kind: ClassVar[str] = "serve config"

    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: list[str] | None = None
    routings: dict[str, str] = field(default_factory=dict)
    default_routing: str | None = None
    max_batch: int = 8
    max_queue: int = 64
    prefix_cache: int = 2048
    prefill_chunk: int = 512
    lean_decode: bool = True
    compile_decode: bool | None = None
    cuda_graphs: bool | None = None
    cuda_graph_columns: int = 4096
    return_routed_experts: bool = False
    max_model_len: int | None = None
    default_max_tokens: int | None = None
    chat_template: str | None = None
    api_key: str | None = field(default=None, repr=False)
    offload: OffloadConfig | None = None
    tokenizer: str | None = None
    read_timeout: float = 30.0
    timeout_keep_alive: float = 5.0
    shutdown_timeout: float = 30.0
    seed: int = 0
    log_level: str = "info"
    threads: int | None = None
    device: str = "cpu"
    dtype: str = "auto"
    quantize: str | None = None

    def __post_init__(self) -> None:
        if self.default_routing is not None and self.default_routing not in self.routings:
            names = ", ".join(sorted(self.routings)) or "none"
            raise ConfigError(
                f"--default-routing {self.default_routing!r} is not a --routing NAME; registered: {names}"
            )
        check_scheme(self.quantize)
        if self.max_batch < 1:
            raise ConfigError(f"--max-batch must be at least 1, got {self.max_batch}")
        if self.max_queue < 1:
            raise ConfigError(f"--max-queue must be at least 1, got {self.max_queue}")
        if self.prefill_chunk < 1:
            raise ConfigError(f"--prefill-chunk must be a number of tokens >= 1, got {self.prefill_chunk}")
        if self.cuda_graph_columns < 1:
            raise ConfigError(f"--cuda-graph-columns must be a number of tokens >= 1, got {self.cuda_graph_columns}")
        if self.prefix_cache < 0:
            raise ConfigError(f"--prefix-cache must be a number of tokens >= 0, got {self.prefix_cache}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"--max-model-len must be a number of tokens >= 1, got {self.max_model_len}")
        if self.default_max_tokens is not None and not (
            self.default_max_tokens >= 1 or self.default_max_tokens == REST_OF_CONTEXT
        ):
            raise ConfigError(
                f"--default-max-tokens must be a number of tokens >= 1, or -1 for the rest of the context; "
                f"got {self.default_max_tokens}"
            )
        if self.chat_template is not None:
            self.template_text()  # a file that is not there, a template that does not compile: refused now
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be at least 1, got {self.threads}")
        if self.served_model_names is not None:
            self.served_model_names = list(self.served_model_names)
            if not self.served_model_names or not all(n.strip() for n in self.served_model_names):
                raise ConfigError("--served-model-name must not be empty")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        self.limits()  # the three timeouts' ranges (ServeLimits' own check)
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 1..65535, got {self.port}")

    def template_text(self) -> str | None:
        """The chat template ``chat_template`` gives (a file's text, or the value itself), compiled;
        None without one."""
        if self.chat_template is None:
            return None
        from moectl.server.chat_template import load_chat_template

        return load_chat_template(self.chat_template)

    def names(self) -> list[str]:
        """The names the server accepts as ``model``, the reported one first."""
        return list(self.served_model_names or [served_name(self.model)])

    def limits(self) -> ServeLimits:
        """The timeouts as uvicorn_run's ``ServeLimits`` (checked there; uvicorn loads on first use:
        without it, :class:`~moectl.errors.MissingExtraError` naming the serve extra)."""
        uvicorn_run = optional_import("moectl.server.uvicorn_run", "moectl.server.ServeConfig")
        return uvicorn_run.ServeLimits(self.read_timeout, self.timeout_keep_alive, self.shutdown_timeout)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready settings without the secrets (:data:`SECRET_FIELDS`): a saved config loads
        back with ``api_key`` None, the key given again when the server starts."""
        data = super().to_dict()
        for name in SECRET_FIELDS:
            data.pop(name, None)
        if self.offload is not None:
            data["offload"] = self.offload.to_dict()  # a policy object by its name, as OffloadConfig saves it
        return data
