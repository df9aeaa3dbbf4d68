"""The engine: the one place moectl runs a model forward for a set of sequences.

Requests join and leave the running batch at step boundaries (continuous batching). A step runs
the scheduler's plan (``scheduler.StepPlan``, chosen before anything runs): it admits waiting
requests while the batch has room — prefilled together, left-padded, in as few forwards as
``batch.prefill_groups`` allows (usually one), their first tokens sampled and their KV cache rows
joined to the batch's (``kv.join``) — then runs one decoding forward for every running row and
samples each row's next token (``sampling.choose_tokens``). A prompt longer than
``EngineConfig.prefill_chunk`` is prefilled in chunks instead, one chunk per step before that
step's decoding forward (so running rows keep producing a token every step), its own cache built
up chunk by chunk, its routing called with each chunk's offset; after its last chunk its first
token is sampled and its cache rows joined to the batch (``rows.splittable``: a routing whose
draws depend on the call order is prefilled in one forward). A row leaves when it reaches
EOS, a stop string, ``max_tokens`` or is cancelled; its cache rows are dropped (``kv.keep``).

Each row carries its own routing (``rows.RowRouter``): none (the model as trained), an expert mask
or subset, a document pool, Gumbel noise, ``option:K`` or a controller with its own option state.
A RoE routing (K routing samples per token, averaged: RoE §2) runs its requests as one ensemble beside
the plain rows, rows joining and leaving it at the same step boundaries (``roe_rows``).
The offload runtime (``moectl.offload.offload``) can sit underneath: the batch's rows then share one
resident expert set, and an expert that any row needs is loaded once per step; ``stats()`` reports
the union of the rows' experts per layer against the budget (above it, a step must reload experts).

A request that asks for log-probabilities (``SamplingParams.logprobs`` / ``prompt_logprobs``) gets
them per generated token and, from its prefill's final hidden states, per prompt token
(``logprobs.py``; such a prompt is prefilled whole).

A request whose routing has ``repeats = K`` takes K rows, its copies' next-token distributions
averaged into one token stream (``repeats.py``). ``EngineConfig(solo=True)`` runs one request at a
time on the model's own cache, for models whose cache cannot be padded and re-batched
(``kv.batchable``: recurrent or linear attention, chunked attention, a cache class of their own).

Use it synchronously (``engine.generate(prompts, params)``, as the batch commands do) or as a
server's back end (``engine.start()``; ``submit(..., on_event=...)`` from any thread; events are
delivered from the engine's thread).

Why not transformers' ``ContinuousBatchingManager``: its paged attention runs the model through its
own attention kernels and batches tokens of all requests as one ragged sequence, so a router sees
no per-request rows to route differently, and it cannot run the offload runtime's expert modules
under its CUDA-graph / paged path; per-row routing needs per-row batch rows.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo, inspect
from moectl.engine.expert_counts import DEFAULT as COUNTS_DEFAULT
from moectl.engine.expert_counts import ExpertCounts
from moectl.engine.kv import check_batchable, new_cache
from moectl.engine.logprobs import TokenLogprob, capture_hidden, of_logits, prompt_logprobs
from moectl.engine.model_runner import ModelRunner
from moectl.engine.output import Output
from moectl.engine.pad_skip import PadSkip
from moectl.engine.penalties import check_bias_ids, penalise
from moectl.engine.prefix_cache import Prefix, PrefixCache
from moectl.engine.prefix_rules import PrefixRules
from moectl.engine.repeats import combine, expand, row_starts, rows_of
from moectl.engine.request import Chunked, Completion, Event, Request
from moectl.engine.roe_experts import check_recordable
from moectl.engine.roe_rows import RoeHost, RoeRows
from moectl.engine.routings import Routing, resolve_all
from moectl.engine.rows import Group, RowRouter, SwitchMeter
from moectl.engine.running import RunningBatch
from moectl.engine.sampling import SamplingParams, request_seed
from moectl.engine.sampling_batch import SamplingBatch
from moectl.engine.scheduler import Scheduler, StepPlan
from moectl.engine.text import TextStream, lone_surrogate
from moectl.errors import ConfigError, MoectlError
from moectl.kernels.cpu_linear import install as install_cpu_linear
from moectl.lm.attention import attention_kernels
from moectl.lm.lm_head import vocab_size
from moectl.lm.padding import left_pad
from moectl.progress import progress_bar
from moectl.routing.keyed_hash import seed_key

log = logging.getLogger("moectl.engine")


def eos_ids(model: nn.Module, tokenizer) -> set[int]:
    """The tokens that end a request: the tokenizer's EOS and the model's ``generation_config``
    ones, as ``model.generate`` and vLLM stop (Qwen3's and gpt-oss's list several)."""
    ids: set[int] = set()
    config = getattr(model, "generation_config", None)
    for value in (getattr(tokenizer, "eos_token_id", None), getattr(config, "eos_token_id", None)):
        if value is not None:
            ids.update(int(e) for e in (value if isinstance(value, (list, tuple)) else [value]))
    return ids


def encode(tokenizer, text: str) -> list[int]:
    """A prompt's token ids as the tokenizer makes them for a batch of one (special tokens included,
    as ``tokenizer([text])`` gives ``model.generate``); text that is not valid Unicode is refused."""
    at = lone_surrogate(text)
    if at is not None:
        raise ConfigError(f"the prompt holds a lone surrogate (U+{ord(text[at]):04X} at character {at}); text must be valid Unicode")
    ids = tokenizer([text])["input_ids"][0]
    return [int(t) for t in (ids.tolist() if isinstance(ids, Tensor) else ids)]


class QueueFull(MoectlError, RuntimeError):
    """The engine's waiting queue holds ``max_queue`` requests already."""


class RequestFailed(RuntimeError):
    """A request of ``Engine.generate`` ended with an error (the engine's message)."""


class EngineClosed(MoectlError, RuntimeError):
    """The engine is shutting down and accepts no new requests."""


@dataclass
class EngineConfig:
    """``max_batch``: rows decoded together; ``max_queue``: requests waiting beyond them.
    ``offload``: an ``OffloadConfig`` to keep only a budget of experts resident (None: all).
    ``log_forwards``: record each forward's kind and rows (a batch run's timeline; a server leaves
    it off, the log would grow without bound)."""

    max_batch: int = 8
    max_queue: int = 64
    offload: Any = None
    log_forwards: bool = False  # keep (prefill | decode, rows) of every forward in ``forward_log``
    prefill_tokens: int = 2048  # the most padded tokens (rows × longest prompt) one prefill forward takes
    prefill_chunk: int = 512  # a longer prompt is prefilled this many tokens per step, between decode steps
    record: bool = False  # each request's routing in its own RoutingTrace (``Completion.trace``)
    skip_padding: bool = True  # a batched prefill's padding tokens skip the experts (engine/pad_skip.py)
    adapt_threads: bool = False  # started as a server: re-pick torch threads as the machine's load changes
    prefix_cache_tokens: int = 0  # prompt tokens whose KV is kept for later prompts (prefix_cache.py); 0: off
    solo: bool = False  # one request at a time, its own cache never padded or re-batched (``kv.batchable``)
    threads: int | None = None  # torch threads of start()'s loop thread (None: the starting thread's count)
    lean_decode: bool = True  # decode through moectl.lm.lean_decode where the family has it (model_runner)
    compile_decode: bool = False  # decode plain steps through one compiled graph (moectl.lm.compiled_decode)
    # with compile_decode: the step over static buffers in CUDA graphs (moectl.lm.graph_decode); None:
    # on CUDA only (True on the CPU runs its uncaptured twin); graph_columns: the longest cache they hold
    graph_decode: bool | None = None
    graph_columns: int = 4096

    def __post_init__(self) -> None:
        PrefixCache(self.prefix_cache_tokens)  # checks the size
        for name in ("max_batch", "max_queue", "prefill_tokens", "prefill_chunk", "graph_columns"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")


def _group(rows: list[int], members: list[Request], offset: int, pad: int = 0) -> Group:
    """The group of ``rows`` (``members``' rows, in order) routed by their shared policies; where the
    policies are keyed by request (``Routing.row_codes``), each row's own code and tokens seen."""
    routing = members[0].routing
    if routing is None or routing.row_codes is None:
        return Group(torch.tensor(rows, dtype=torch.long), members[0].policies, offset, pad)
    codes = torch.cat([r.routing.row_codes for r in members])  # type: ignore[union-attr]
    offsets = torch.tensor([r.seen for r in members for _ in range(r.copies)], dtype=torch.long)
    return Group(torch.tensor(rows, dtype=torch.long), members[0].policies, offset, pad, offsets, codes)


def _traces(req: Request) -> list:
    """The request's trace per row it occupies."""
    return req.trace if isinstance(req.trace, list) else [req.trace]


class Engine:
    """Continuous batching with routing per row over one model (see the module doc)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        config: EngineConfig | None = None,
        routings: Mapping[str, Any] | None = None,
        *,
        info: ModelInfo | None = None,
        reader=None,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        install_cpu_linear(model)  # bf16 CPU products at the memory's speed (moectl.kernels.cpu_linear)
        self.config = config or EngineConfig()
        self.info = info or inspect(model)
        self.routings: dict[str, Routing] = resolve_all(routings, model, self.info)
        self.reader = reader
        self.device = next(p.device for p in model.parameters())
        self.vocab = vocab_size(model)  # rows of the logits: the token ids a request may name
        self.max_context = int(getattr(model.config, "max_position_embeddings", 0) or 0) or None
        self.eos_ids = eos_ids(model, tokenizer)
        pad = getattr(tokenizer, "pad_token_id", None)
        self._pad_id = int(pad) if isinstance(pad, int) else 0  # any id: padding is masked out
        # the one caller of the model's forward; offloading decodes every step through the experts'
        # own modules (``_plain``), so no compiled step is built for it (its warm-up would compile a
        # graph never run, over experts that may not be in memory: time and RSS under a memory cap)
        compiled = self.config.compile_decode and self.config.offload is None
        self.runner = ModelRunner(model, self.config.lean_decode, compiled, self.info, self._graph_shape())
        self.router = RowRouter()
        self.meter = SwitchMeter(self.info, self.router)
        self.expert_counts = ExpertCounts(self.info)  # expert use per routing over a window (start/stop/dump)
        self._pad_skip = PadSkip()
        self.counters = {
            "steps": 0,
            "prefills": 0,
            "prefill_forwards": 0,
            "generated_tokens": 0,
            "finished": 0,
            "errors": 0,
            "prefix_tokens_reused": 0,
        }
        self.output = Output(self.info, self.eos_ids, self.counters)  # tokens to requests, requests to their ends
        self.output.compiled = self.runner.compiled is not None
        self.batch = RunningBatch(self.device)  # the requests decoding together and their rows' tensors
        self._residency: list = []  # the offload policy's routing (composed into RoE ensembles too)
        # RoE requests: one K-sample ensemble per routing (roe_rows), handed what they use of the engine
        self._roe_rows = RoeRows(
            RoeHost(model, self.info, self.config.prefill_tokens, self._pad_id, self.device, self.output,
                    self.counters, self._choose, self._log, lambda: self._residency)
        )  # fmt: skip
        self.prefixes = PrefixCache(self.config.prefix_cache_tokens)
        self.prefix_rules = PrefixRules(self.prefixes, record=self.config.record, solo=self.config.solo)
        # the waiting queue and each step's plan of admissions (scheduler.py)
        self.scheduler = Scheduler(self.config, self.prefix_rules, self._roe_rows.batches)
        self._chunked: deque[Chunked] = deque()  # long prompts prefilled a chunk per step, oldest first
        self._ids = itertools.count()
        self._session = None
        self._offload = None
        self.runtime = None  # the OffloadRuntime while open, if offloading
        self._experts_before: str | None = None  # the experts implementation to restore on close
        self._thread: threading.Thread | None = None
        self._warm_in_loop = False  # started as a server: the loop thread warms the compiled step up
        self._warmed = False  # the compiled step's graphs built (``_warm_up``)
        self._stopping = False
        self._drain = True
        self._abort_asked = False  # abort(): the loop cancels every request at its next turn (output.aborted)
        self._checked_cache = False
        self._union = [0.0, 0, 0]  # offloading: Σ mean union per layer, max union, decode steps
        self.forward_log: list[tuple[str, int]] = []  # with config.log_forwards: (kind, rows) per forward

    # -- lifecycle ----------------------------------------------------------------------------
    def open(self, warm_up: bool = True) -> Engine:
        """Install the routing (and the offload runtime); ``close()`` removes them. ``warm_up=False``:
        leave the compiled step's graphs to ``start``'s loop thread (a server opens first, to report
        what cannot be installed, then starts: a warm-up here would give this thread an OpenMP pool
        of the loop's size, which slowed the loop's steps 2x, lean and compiled alike)."""
        if warm_up is False:
            self._warm_in_loop = True
        if self._session is not None:
            return self
        from moectl.routing.session import route

        policies: list = []
        try:
            if self.config.offload is not None:
                from moectl.offload.runtime import offload

                impl = getattr(self.model.config, "_experts_implementation", None)
                if impl not in (None, "eager") and hasattr(self.model, "set_experts_implementation"):
                    self.model.set_experts_implementation("eager")  # offloading runs the experts' own forward
                    self._experts_before = impl
                runtime = offload(self.model, self.config.offload, reader=self.reader)
                self.runtime = runtime.__enter__()  # a failed entry cleans up after itself
                self._offload = runtime
                policies += list(self.runtime.policy.routing(self.runtime.info))
            self._residency = policies
            self.prefix_rules.residency = bool(policies)  # routing follows the resident set: no prefixes
            if not self._warm_in_loop:
                self._warm_up()
            self._session = route(self.model, [*policies, self.router], info=self.info)
            self._session.__enter__()
            self.meter.install(self.model)
            session = self._session
            self.expert_counts.install(lambda: session.ctx.valid)
            if self.config.skip_padding:
                self._pad_skip.install(self.info)  # on the experts modules in place (offloaded ones included)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        self.meter.remove()
        self.expert_counts.remove()
        self._pad_skip.remove()
        if self._session is not None:
            self._session.close()
            self._session = None
        try:
            if self._offload is not None:
                offloaded, self._offload, self.runtime = self._offload, None, None
                offloaded.__exit__(None, None, None)
        finally:
            if self._experts_before is not None:
                self.model.set_experts_implementation(self._experts_before)
                self._experts_before = None

    def __enter__(self) -> Engine:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _graph_shape(self) -> tuple[int, int] | None:
        """(rows, columns) of the CUDA graphs' static buffers (``EngineConfig.graph_decode``), or None:
        the batch's rows, and the cache's columns up to ``graph_columns`` or the model's context."""
        graphs = self.config.graph_decode
        if not (graphs if graphs is not None else self.device.type == "cuda"):
            return None
        columns = min(self.config.graph_columns, self.max_context or self.config.graph_columns)
        return self.config.max_batch, columns

    def _warm_up(self) -> None:
        """Build the compiled step's graphs before the first request (``CompiledDecode.warm_up``), for
        the thread counts the steps run with; a failure leaves the lean forward to decode. A server
        (``start``) builds them in its loop thread: warming up in the opening thread with the loop's
        count would give that thread an OpenMP pool of several threads beside the loop's, which
        slows the loop (``server/serve_run.py``)."""
        if self.runner.compiled is None or not self.config.compile_decode or self._warmed:
            return
        self._warmed = True
        try:
            with attention_kernels(self.device):
                seconds = self.runner.compiled.warm_up(self._step_threads())
            log.info("decoding step compiled in %.1f s (%s)", seconds, self.runner.path)
        except Exception as err:  # no C++ compiler, an inductor error: the lean forward decodes
            self.runner.disable(err)
            self.output.compiled = False

    def _step_threads(self) -> tuple[int, ...]:
        """The torch thread counts the steps will run with: ``start``'s loop count, and one where the
        loop re-picks its count under load (``adapt_threads``: its governor then chooses between
        the two, so the compiled step's graphs, one per count, are all built before the first
        request)."""
        threads = self.config.threads or torch.get_num_threads()
        return tuple(sorted({1, threads})) if self.config.adapt_threads else (threads,)

    def start(self) -> Engine:
        """Run the step loop in a background thread (a server's mode), with ``config.threads`` torch
        threads (else the calling thread's count). Keep other threads' torch work to one thread
        meanwhile: OpenMP pools of several threads in two threads slow the loop's (``moectl serve``
        loads the model with one thread for that reason; see ``cli/serve.py``)."""
        if self._thread is not None:
            return self
        self._warm_in_loop = True  # the compiled step's graphs: built by the loop thread (``_warm_up``)
        self.open()
        threads = self.config.threads or torch.get_num_threads()  # OpenMP's thread count is per thread
        self._thread = threading.Thread(target=self._loop, args=(threads,), name="moectl-engine", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting; with ``drain`` finish the running and waiting requests, else cancel them."""
        with self.scheduler.lock:
            self._stopping, self._drain = True, drain
            self.scheduler.lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self.close()

    def abort(self) -> None:
        """Finish every request, running or waiting, at the next step boundary with
        ``finish_reason: "abort"`` (vLLM's); new requests are still accepted unless shutting down.
        A server calls it when its shutdown deadline passes."""
        with self.scheduler.lock:
            self._abort_asked = True
            self.scheduler.lock.notify_all()

    # -- requests -----------------------------------------------------------------------------
    def submit(
        self,
        prompt: Sequence[int] | str,
        params: SamplingParams | None = None,
        routing: str | Routing | None = None,
        on_event: Callable[[Event], None] | None = None,
    ) -> str:
        """Queue a request; returns its id. Thread-safe. ``ValueError`` for an unknown routing or a
        prompt that does not fit the context, ``QueueFull`` when ``max_queue`` are waiting.
        ``routing``: a registered name (all a server passes on), or in process a ``Routing`` object."""
        return self._submit(prompt, params, routing, on_event).id

    def _submit(
        self,
        prompt: Sequence[int] | str,
        params: SamplingParams | None,
        routing: str | Routing | None,
        on_event: Callable[[Event], None] | None,
    ) -> Request:
        params = params or SamplingParams()
        check_bias_ids(params, self.vocab)
        ids = encode(self.tokenizer, prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ConfigError("the prompt is empty (no tokens)")
        if routing is not None and not isinstance(routing, Routing) and routing not in self.routings:
            names = ", ".join(sorted(self.routings)) or "none registered"
            raise ConfigError(f"unknown routing {routing!r}; registered routings: {names}")
        if self.max_context is not None and len(ids) + params.max_tokens > self.max_context:
            raise ConfigError(
                f"the prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the model's "
                f"context of {self.max_context} tokens"
            )
        chosen = routing if isinstance(routing, Routing) or routing is None else self.routings.get(routing)
        copies = chosen.repeats if chosen is not None else 1
        if params.prompt_logprobs is not None and (copies > 1 or (chosen is not None and chosen.roe is not None)):
            raise ConfigError("prompt log-probabilities (echo) need a routing of one row per request, not RoE or repeats")
        if copies > self.config.max_batch:
            raise ConfigError(f"repeats = {copies} needs more rows than max_batch = {self.config.max_batch}")
        if params.return_routed_experts and copies > 1:
            raise ConfigError("return_routed_experts needs a routing of one row per request; a repeats routing runs K copies")
        if params.return_routed_experts and chosen is not None and chosen.roe is not None:
            check_recordable(chosen)  # its K samples' experts, as the clean cache lays them out
        seed = request_seed(params)
        policies = [] if chosen is None else chosen.for_request(seed, self.info)
        trace = self._new_trace(params)  # None where nothing is recorded; one per copy where it is
        traces = trace if copies == 1 or trace is None else [trace, *(self._new_trace(params) for _ in range(copies - 1))]
        stream = TextStream(self.tokenizer, params.stop, params.min_tokens)  # its automaton: outside the lock
        with self.scheduler.lock:
            if self._stopping:
                raise EngineClosed("the engine is shutting down")
            if len(self.scheduler.waiting) >= self.config.max_queue:
                raise QueueFull(f"{len(self.scheduler.waiting)} requests are waiting (max_queue)")
            req = Request(
                id=f"req-{next(self._ids)}",
                prompt=ids,
                params=params,
                routing=chosen,
                policies=policies,
                key=seed_key(seed),
                on_event=on_event,
                stream=stream,
                trace=traces,
                copies=copies,
            )
            self.scheduler.waiting.append(req)
            self.scheduler.lock.notify_all()
        return req

    def cancel(self, request_id: str) -> None:
        """Finish a request at the next step boundary (its row and cache are freed)."""
        with self.scheduler.lock:
            self.scheduler.cancelled.add(request_id)
            self.scheduler.lock.notify_all()

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        routing: str | Routing | Sequence[str | Routing | None] | None = None,
        progress: bool = False,
        seed_per_prompt: bool = False,
        on_event: Callable[[int, Event], None] | None = None,
    ) -> list[Completion]:
        """Run ``prompts`` to completion (in this thread unless ``start()`` was called); in order.
        ``progress``: a progress bar of generated tokens (at most ``max_tokens`` per prompt).
        ``seed_per_prompt``: prompt i samples with seed ``params.seed + i`` (independent draws).
        ``params`` and ``routing`` may also be given per prompt (sequences as long as ``prompts``);
        a ``Routing`` object is a caller's own (``Routing.of``), used without registering it.
        ``on_event(i, event)``: each event of prompt i as it comes (streaming)."""
        per_params = list(params) if isinstance(params, (list, tuple)) else None
        per_routing = list(routing) if isinstance(routing, (list, tuple)) else [routing] * len(prompts)
        if len(per_routing) != len(prompts) or (per_params is not None and len(per_params) != len(prompts)):
            raise ConfigError("give one params and one routing per prompt, or one for all")
        if per_params is None:
            params = params if isinstance(params, SamplingParams) else SamplingParams()
            if seed_per_prompt and params.seed is not None:
                per_params = [replace(params, seed=params.seed + i) for i in range(len(prompts))]
            else:
                per_params = [params] * len(prompts)
        pending = list(zip(prompts, per_params, per_routing, strict=True))
        own_loop = self._thread is None
        opened = own_loop and self._session is None
        if opened:
            self.open()
        try:
            with progress_bar("generating", progress) as bar:
                task = bar.add_task("gen", total=sum(p.max_tokens for p in per_params))
                start = self.counters["generated_tokens"]

                def advance() -> None:
                    bar.update(task, completed=self.counters["generated_tokens"] - start)

                return self._run(pending, own_loop, advance, on_event)
        finally:
            if opened:
                self.close()

    def _run(
        self,
        pending: list[tuple[Any, SamplingParams, str | Routing | None]],
        own_loop: bool,
        advance: Callable[[], None],
        on_event: Callable[[int, Event], None] | None = None,
    ) -> list[Completion]:
        ids: list[str] = []
        reqs: dict[str, Request] = {}
        while pending or any(not reqs[i].done.is_set() for i in ids):
            while pending and len(self.scheduler.waiting) < self.config.max_queue:
                prompt, params, routing = pending.pop(0)
                listen = None if on_event is None else functools.partial(on_event, len(ids))
                req = self._submit(prompt, params, routing, listen)
                ids.append(req.id)
                reqs[req.id] = req
            if own_loop:
                self.step()
                advance()
            else:
                next(r for r in reqs.values() if not r.done.is_set()).done.wait(0.05)
        done = [reqs[i].completion for i in ids]
        failed = next((c for c in done if c is not None and c.error is not None), None)
        if failed is not None:
            raise RequestFailed(failed.error)
        return done  # type: ignore[return-value]

    # -- the step -----------------------------------------------------------------------------
    def _loop(self, threads: int) -> None:
        torch.set_num_threads(threads)
        self._warm_up()  # before the first step, in this thread (``_warm_up``)
        governor = None
        if self.config.adapt_threads:
            from moectl.threads import ThreadGovernor

            # with a compiled step, one of the counts its graphs were built for (``_step_threads``)
            choices = self._step_threads() if self.runner.compiled is not None else None
            governor = ThreadGovernor(choices=choices)
        while True:
            if governor is not None:
                governor.update()  # in this thread: torch's thread count is per thread under OpenMP
            with self.scheduler.lock:
                busy = self._busy()
                while not self._stopping and not self.scheduler.waiting and not busy and not self._abort_asked:
                    self.scheduler.lock.wait()
                    busy = self._busy()
                if (self._stopping and not self._drain) or self._abort_asked:
                    chunked = [c.req for c in self._chunked]
                    every = {r.id for r in (*self.scheduler.waiting, *self.batch, *self._roe_rows, *chunked)}
                    self.scheduler.cancelled |= every
                    if self._abort_asked:
                        self.output.aborted |= every
                        self._abort_asked = False
                if self._stopping and not self.scheduler.waiting and not busy:
                    return
            self.step()

    def _busy(self) -> bool:
        return bool(self.batch or self._roe_rows or self._chunked)

    def step(self) -> bool:
        """One engine step: the scheduler's plan of admissions (``scheduler.StepPlan``) prefilled,
        cancelled requests dropped, one chunk of a long prompt prefilled, the batch decoded.
        Returns whether any work was done."""
        with torch.inference_mode(), attention_kernels(self.device):
            try:
                rows = self.batch.rows + len(self._roe_rows) + len(self._chunked)
                plan = self.scheduler.schedule(rows, [c.req for c in self._chunked])
                self._admit(plan)
                self._drop_cancelled()
                chunked = self._prefill_chunk()
                if not self.batch and not self._roe_rows:
                    return plan.admitted or chunked
                if self.batch:
                    self._decode()
                self._roe_rows.step()
            except Exception as err:  # the batch is lost; the requests get the error, serving goes on
                self._fail_all(err)
            self.counters["steps"] += 1
            return True

    def _admit(self, plan: StepPlan) -> None:
        """Run the plan's prefills, a few forwards at most; a failing one finishes its requests alone
        (where nothing else runs, the step fails and the later ones go back to the queue)."""
        for req in plan.cancelled:
            self.output.finish(req, "cancelled")
        self._chunked.extend(self._start_chunked(r) for r in plan.chunked)
        work: list[tuple[Callable[[Any], None], Any]] = [
            *((self._roe_rows.prefill, reqs) for reqs in plan.roe),
            *((self._prefill_after, jobs) for jobs in plan.after_prefix),
            *((self._prefill_shared if len(reqs) > 1 else self._prefill, reqs) for reqs in plan.prefills),
        ]
        for done, (prefill, arg) in enumerate(work):
            err = self._isolated(prefill, arg)
            if err is not None and not self.batch and not self._roe_rows:  # nothing runs: fail the step
                self.scheduler.put_back([r for _, a in work[done + 1 :] for r in _requests_of(a)])
                raise err

    def _prefill_shared(self, reqs: list[Request]) -> None:
        """Several requests in one forward; if it fails, each alone, so only a bad one fails."""
        try:
            self._prefill(reqs)
        except Exception:
            if any(r is q for r in self.batch for q in reqs):
                raise  # failed after joining the batch: not a prefill to redo
            for req in reqs:
                self._isolated(self._prefill, [req])

    def _isolated(self, prefill: Callable[[Any], None], arg) -> Exception | None:
        """Run a prefill; an error finishes its requests (those not finished yet) and is returned."""
        try:
            prefill(arg)
        except Exception as err:
            for req in _requests_of(arg):
                if not req.done.is_set():
                    self.output.finish(req, "error", error=f"{type(err).__name__}: {err}")
            return err
        return None

    def _prefill(self, reqs: list[Request]) -> None:
        """One forward over the prompts of ``reqs``, left-padded to the longest (each row with its own
        positions 0..n−1 and, through ``Group.pad``, its own routing over its own tokens), then their
        first tokens sampled and their cache rows joined to the batch's."""
        copies = [r.copies for r in reqs]
        k = sum(copies)  # rows: a request of K copies takes K (repeats.py)
        lengths = [len(r.prompt) for r in reqs]
        width = max(lengths)
        ids, mask = left_pad([r.prompt for r in reqs for _ in range(r.copies)], self._pad_id, self.device)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        cache = None if self.config.solo else new_cache(self.model)  # solo: the model's own cache
        groups: dict[tuple[int, int], tuple[list[int], list[Request]]] = {}
        for i, req in enumerate(reqs):
            if req.policies:
                rows, members = groups.setdefault((id(req.policies), width - lengths[i]), ([], []))
                rows.extend(rows_of(copies, [i]))
                members.append(req)
        prev, switches = self.meter.new_rows(k, self.device)
        routed = [_group(rows, members, 0, pad) for (_, pad), (rows, members) in groups.items()]
        self._prepare("prefill", reqs, routed, prev, switches, lengths, [0] * len(reqs), width=width)
        echo = [i for i, r in enumerate(reqs) if r.params.prompt_logprobs is not None]
        with capture_hidden(self.model, bool(echo)) as hidden:
            logits, cache = self._prefill_forward(ids, mask, positions, cache)
        starts = row_starts(copies)
        for i in echo:  # position j of a prompt predicts its token j + 1
            req, row = reqs[i], starts[i]
            states = hidden[-1][row, width - lengths[i] : width - 1]
            req.prompt_lp = prompt_logprobs(self.model, states, req.prompt[1:], req.params.prompt_logprobs or 0)
        del hidden
        self._join_rows(reqs, cache, mask, logits, prev, switches)

    def _prefill_after(self, jobs: list[tuple[Request, Prefix]]) -> None:
        """One forward over the remaining prompt tokens of requests with stored prefixes: the batch's
        cache starts as their prefixes, each left-padded to the longest, and the remaining tokens
        follow, left-padded too, so a row's real columns are [pad | prefix | pad | rest]; the 2-D
        attention mask marks them and each row's positions continue from its prefix (m, m+1, …), as
        in a prefill of the whole prompt. Each row's routing sees its own remaining tokens at its own
        offset m (``rows.Group``)."""
        reqs = [req for req, _ in jobs]
        k, dev = len(jobs), self.device
        starts = [prefix.length for _, prefix in jobs]
        width = max(starts)
        cache = new_cache(self.model)
        for layer in range(len(jobs[0][1].layers)):
            keys = torch.cat([F.pad(p.layers[layer][0], (0, 0, width - p.length, 0)) for _, p in jobs])
            values = torch.cat([F.pad(p.layers[layer][1], (0, 0, width - p.length, 0)) for _, p in jobs])
            cache.update(keys, values, layer)
        start = torch.tensor(starts, device=dev)
        before = (torch.arange(width, device=dev)[None, :] >= (width - start)[:, None]).long()
        rest = [req.prompt[m:] for req, m in zip(reqs, starts, strict=True)]
        ids, rest_mask = left_pad(rest, self._pad_id, dev)
        mask = torch.cat([before, rest_mask], 1)
        positions = start[:, None] + (rest_mask.cumsum(1) - 1).clamp(min=0)
        groups: dict[tuple[int, int, int], list[int]] = {}
        for i, req in enumerate(reqs):
            if req.policies:
                groups.setdefault((id(req.policies), ids.shape[1] - len(rest[i]), starts[i]), []).append(i)
        routed = [Group(torch.tensor(rows), reqs[rows[0]].policies, m, pad) for (_, pad, m), rows in groups.items()]
        prev, switches = self.meter.new_rows(k, dev)
        lengths = [len(r) for r in rest]  # the rests' padding skips the experts
        self._prepare("prefill", reqs, routed, prev, switches, lengths, starts, width=ids.shape[1])
        logits, cache = self._prefill_forward(ids, mask, positions, cache)
        self.counters["prefix_tokens_reused"] += sum(starts)
        self._join_rows(reqs, cache, mask, logits, prev, switches)

    def _prefill_forward(self, ids: Tensor, mask: Tensor, positions: Tensor, cache) -> tuple[Tensor, Any]:
        """One prefill forward (routing set up by the caller, torn down here): the last position's
        logits and the cache; the first such forward checks that the cache can be re-batched."""
        try:
            logits, cache = self.runner.prefill(ids, mask, positions, cache)
        finally:
            self._between_steps()
        if not self._checked_cache and not self.config.solo:
            check_batchable(cache, self.model.config)
            self._checked_cache = True
        self.counters["prefill_forwards"] += 1
        return logits, cache

    def _join_rows(
        self, reqs: list[Request], cache, mask: Tensor, logits: Tensor, prev: Tensor, switches: Tensor
    ) -> None:
        """Prefilled requests join the batch: each one-copy row's prompt KV offered to the prefix
        cache, their first tokens sampled from ``logits`` [rows, V], their cache rows (left-padded as
        ``mask`` [rows, L] marks), ω and switch counts appended to the batch's."""
        copies = [r.copies for r in reqs]
        for req, row in zip(reqs, row_starts(copies), strict=True):
            req.seen = len(req.prompt)
            if req.copies == 1:
                self.prefix_rules.store(req, cache, row, mask[row].bool())
        self.counters["prefills"] += len(reqs)
        sampling = self._sampling(reqs)
        tokens = self._choose(logits, reqs, sampling)
        sampling.advance()
        first = self.batch.join(reqs, cache, mask, prev, switches, expand(tokens, copies), sampling)
        finished = [
            first + i
            for i, (req, tok) in enumerate(zip(reqs, tokens.tolist(), strict=True))
            if self.output.emit(req, tok)
        ]
        if finished:
            self._remove(finished)

    def _start_chunked(self, req: Request) -> Chunked:
        return Chunked(req, new_cache(self.model), *self.meter.new_rows(1, self.device))

    def _prefill_chunk(self) -> bool:
        """The next ``prefill_chunk`` tokens of the oldest chunked prompt through the model, on its
        own cache (positions and routing offset continuing from the tokens before); after the last
        chunk the request joins the batch. An error finishes that request alone."""
        if not self._chunked:
            return False
        chunked = self._chunked[0]
        req = chunked.req
        start, n = req.seen, len(req.prompt)
        stop = min(n, start + self.config.prefill_chunk)
        ids = torch.tensor([req.prompt[start:stop]], device=self.device)
        mask = torch.ones(1, stop, dtype=torch.long, device=self.device)
        positions = torch.arange(start, stop, device=self.device)[None]
        groups = [_group([0], [req], start)] if req.policies else []
        self._prepare("chunk", [req], groups, chunked.prev, chunked.switches, [stop - start], [start])
        try:
            logits, chunked.cache = self._prefill_forward(ids, mask, positions, chunked.cache)
        except Exception as err:
            self._chunked.popleft()
            self.output.finish(req, "error", error=f"{type(err).__name__}: {err}")
            return True
        req.seen = stop
        if stop == n:
            self._chunked.popleft()
            self._join_rows([req], chunked.cache, mask, logits, chunked.prev, chunked.switches)
        return True

    def _new_trace(self, params: SamplingParams):
        """A request's RoutingTrace where it is recorded: every request under ``EngineConfig.record``,
        one that asks for ``return_routed_experts``."""
        if not (self.config.record or params.return_routed_experts):
            return None
        from moectl.routing.trace import RoutingTrace

        meta = {"family": self.info.family, "moe_layers": [layer.layer_idx for layer in self.info.layers]}
        return RoutingTrace(self.info.num_moe_layers, meta)

    def _prepare(
        self, kind: str, reqs: list[Request], groups: list[Group], prev: Tensor | None, switches: Tensor | None,
        lengths: list[int], offsets: list[int], width: int | None = None,
    ) -> None:  # fmt: skip
        """Set up the next forward over the rows of ``reqs``: their routing groups, ω and switch
        counts (counted when decoding), each recording request's trace call (its own length and
        offset: the tokens it has seen), the rows' expert counts, a batched prefill's left padding to
        ``width`` (skipping the experts: ``pad_skip``) and the forward log. ``_between_steps`` undoes it."""
        rows = sum(r.copies for r in reqs)
        self.router.set_groups(groups, rows, self.device)
        self.meter.start(prev, switches, counting=kind == "decode")
        self._begin_traces(reqs, lengths, offsets)
        if width is not None:
            row_lengths = [n for n, r in zip(lengths, reqs, strict=True) for _ in range(r.copies)]
            self.meter.pads = [width - n for n in row_lengths]
            self._pad_skip.keep(row_lengths, width, self.device)
        self._log(kind, rows)

    def _begin_traces(self, reqs: list[Request], lengths: list[int], offsets: list[int]) -> None:
        """Open a call in each recording request's trace (its own offset: the tokens it has seen;
        its own length: a prefill's rows record their own prompt, not its padding)."""
        self._count_rows(reqs)
        if not any(req.trace is not None for req in reqs):
            self.meter.traces = None
            return
        for req, length, offset in zip(reqs, lengths, offsets, strict=True):
            if req.trace is None:
                continue
            valid = torch.ones(1, length, dtype=torch.bool, device=self.device)
            prompt_len = len(req.prompt) if offset < len(req.prompt) else None
            for trace in _traces(req):
                trace.begin_call(offset, valid, prompt_len)
        self.meter.traces = [t for r in reqs for t in _traces(r)]  # None for the rows not recorded

    def _count_rows(self, reqs: list[Request]) -> None:
        """Each row's routing name for the expert counts of the next forward (expert_counts.py)."""
        if self.expert_counts.recording:
            names = [req.routing.stats_name if req.routing is not None else COUNTS_DEFAULT for req in reqs]
            self.expert_counts.begin([n for n, r in zip(names, reqs, strict=True) for _ in range(r.copies)], self.device)

    def _log(self, kind: str, rows: int) -> None:
        if self.config.log_forwards:
            self.forward_log.append((kind, rows))

    def _between_steps(self) -> None:
        """After a forward: ω and switch counts updated; outside the engine's own forwards the model
        routes as it would without the engine."""
        self.meter.end()
        self.expert_counts.end()
        self.router.set_groups([], 0, self.device)
        self.meter.start(None, None, counting=False)
        self.meter.traces = self.meter.pads = None
        self._pad_skip.keep(None)

    def _sampling(self, reqs: list[Request]) -> SamplingBatch:
        """The sampler's tensors for ``reqs`` (built when they join the batch, not at every step)."""
        steps = [len(r.generated) for r in reqs]
        return SamplingBatch.of([r.params for r in reqs], [r.key for r in reqs], steps, self.device)

    def _choose(
        self, logits: Tensor, reqs: list[Request], sampling: SamplingBatch | None = None, greedy: Tensor | None = None
    ) -> Tensor:
        """Each request's next token (a request's K copies: one distribution, ``repeats.combine``),
        after the penalties and bias of the requests that ask for them (``penalties.penalise``):
        greedy requests only need the argmax, else ``choose_tokens`` with the requests' parameters
        (``sampling``: the running batch's, kept from step to step; None: built for ``reqs``).
        Reported log-probabilities are the model's, before penalties, temperature and filters.
        ``greedy``: the rows' argmax where the step computed it (the compiled step), taken where
        every request is greedy, one row, unpenalised."""
        raw = combine(logits, [r.copies for r in reqs])
        logits = penalise(raw, reqs, self.eos_ids)
        if greedy is not None and len(greedy) == len(reqs) and all(  # one row each (no copies to combine)
            r.params.temperature == 0 and not r.params.penalised for r in reqs
        ):
            tokens = greedy
        elif sampling is None and all(r.params.temperature == 0 for r in reqs):
            tokens = logits.argmax(-1)  # nothing to build
        else:
            tokens = (sampling or self._sampling(reqs)).choose(logits)
        wanted = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if wanted:  # only requests that ask pay for the softmax and its host copy
            top = max(reqs[i].params.logprobs or 0 for i in wanted)
            index = torch.tensor(wanted, device=raw.device)  # the model's distribution, before penalties
            for i, one in zip(wanted, of_logits(raw[index], tokens[index], top), strict=True):
                n = reqs[i].params.logprobs or 0
                reqs[i].chosen_lp = TokenLogprob(one.token, one.logprob, one.top[:n])
        return tokens

    def _groups(self) -> list[Group]:
        by_policies: dict[int, tuple[list[int], list[Request]]] = {}
        for req, start in zip(self.batch, row_starts(self.batch.copies()), strict=True):
            if req.policies:
                rows, members = by_policies.setdefault(id(req.policies), ([], []))
                rows.extend(range(start, start + req.copies))
                members.append(req)
        return [_group(rows, members, members[0].seen) for rows, members in by_policies.values()]

    def _decode(self) -> None:
        batch = self.batch
        assert batch.valid is not None and batch.last is not None and batch.sampling is not None
        b = batch.rows  # a request of K copies takes K
        offsets = [r.seen for r in batch]
        self._prepare("decode", batch.requests, self._groups(), batch.prev, batch.switches, [1] * len(batch), offsets)
        valid = torch.cat([batch.valid, torch.ones(b, 1, dtype=torch.bool, device=batch.valid.device)], 1)
        try:
            plain, masks, renorm = self._plain()
            logits, cache = self.runner.decode(batch.last, valid, batch.positions, batch.cache, plain, masks,
                                               renorm)  # fmt: skip
            if self.runner.result is not None:  # the compiled step ran no hooks: its choices counted here
                self.meter.chose(self.runner.result.chosen, self.runner.result.omega)
            elif self.runner.reason is not None:  # a compiled runner's step left to the lean forward
                for req in batch.requests:
                    req.slow_reasons.add(self.runner.reason)
        finally:
            self._between_steps()
        if self.runtime is not None:  # what this step's rows needed together, per MoE layer (host ints)
            unions = [m.union for m in self.runtime.modules]
            self._union[0] += sum(unions) / len(unions)
            self._union[1] = max(self._union[1], max(unions))
            self._union[2] += 1
        greedy = None if self.runner.result is None else self.runner.result.greedy
        tokens = self._choose(logits, batch.requests, batch.sampling, greedy)
        batch.advance(cache, valid, expand(tokens, batch.copies()))
        finished = [
            i
            for i, (req, tok) in enumerate(zip(batch, tokens.tolist(), strict=True))
            if self.output.emit(req, tok)
        ]
        if finished:
            self._remove(finished)

    def _plain(self) -> tuple[str | None, list[Tensor | None] | None, str]:
        """Whether this decoding step may run compiled (``model_runner``): None where every row is
        routed as the model routes it or by an expert mask and nothing records the step, else the
        feature that needs the routers' hooks; the rows' masks per MoE layer ([B, E] or None) and
        their renormalisation (``RowRouter.mask_rows``)."""
        if self.runtime is not None or self._residency:
            return "offloading", None, "pruned"
        if self.meter.traces is not None:
            return "recording the routing (traces, routed experts)", None, "pruned"
        if self.expert_counts.recording:
            return "expert counts", None, "pruned"
        if self._session is None:
            return "the engine is not open", None, "pruned"
        if not self.router.groups:
            return None, None, "pruned"
        return self.router.mask_rows()

    def _remove(self, rows: list[int]) -> None:
        """Drop ``rows`` from the batch and finish their requests (``ending``; else cancelled)."""
        for req in self.batch.drop(set(rows)):
            reason, piece = req.ending or ("cancelled", "")
            self.output.finish(req, reason, piece=piece)

    def _drop_cancelled(self) -> None:
        cancelled = self.scheduler.take_cancelled()
        if not cancelled:
            return
        rows = [i for i, r in enumerate(self.batch) if r.id in cancelled]
        if rows:
            self._remove(rows)
        for chunked in [c for c in self._chunked if c.req.id in cancelled]:
            self._chunked.remove(chunked)  # its cache goes with it
            self.output.finish(chunked.req, "cancelled")
        self._roe_rows.cancel(cancelled)
        with self.scheduler.lock:  # ones still waiting are finished when admitted
            self.scheduler.cancelled |= {c for c in cancelled if any(r.id == c for r in self.scheduler.waiting)}

    def _fail_all(self, err: Exception) -> None:
        self.counters["errors"] += 1
        failed = [*self.batch.clear(), *self._roe_rows.clear()]
        for req in failed:
            self.output.finish(req, "error", error=f"{type(err).__name__}: {err}")

    # -- figures ------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters, queue, per-routing switch rates and (offloading) the resident set's figures."""
        with self.scheduler.lock:
            waiting = len(self.scheduler.waiting)
        out: dict[str, Any] = {
            **self.counters,
            "running": len(self.batch) + len(self._roe_rows) + len(self._chunked),
            "waiting": waiting,
            "decode_forward": {"path": self.runner.path, **self.runner.calls, "slow": dict(self.runner.slow)},
            "switch_rate": {
                name: (s["switches"] / s["steps"] if s["steps"] else None)
                for name, s in self.output.routing_stats.items()
            },
        }
        if self.runtime is not None:
            totals = self.runtime.totals()
            accesses = totals["hits"] + totals["misses"]
            out["offload"] = {
                "resident_experts": sum(len(r.resident) for r in self.runtime.resident_sets),
                "budget_experts": sum(r.budget for r in self.runtime.resident_sets),
                "resident_expert_bytes": totals["resident_expert_bytes"],
                "hits": totals["hits"],
                "misses": totals["misses"],
                "hit_rate": totals["hits"] / accesses if accesses else None,
                "bytes_moved": totals["bytes_moved"],
                "loads": totals["loads"],
                # distinct experts a decoding step's rows need together per MoE layer (mean over steps
                # and layers, max); above the budget per layer a step must reload experts
                "union_mean": self._union[0] / self._union[2] if self._union[2] else None,
                "union_max": self._union[1] if self._union[2] else None,
                "budget_per_layer": max(r.budget for r in self.runtime.resident_sets),
            }
        return out


def _requests_of(arg: Any) -> list[Request]:
    """The requests of one prefill job: a list of requests or of (request, prefix), or one request."""
    items = arg if isinstance(arg, list) else [arg]
    return [item[0] if isinstance(item, tuple) else item for item in items]
