"""The decoding step over static buffers, replayed as CUDA graphs on a GPU (issue 39 item 3).

On a GPU a decoding step's kernels are short and many (OLMoE-1B-7B: ~30 per layer); launched one by
one from Python, the host is the bottleneck (the one H200 run: 8.2 ms a step at 4 of 16 layers for
~0.75 GB of weights, ~55x the time HBM needs to read them). vLLM and SGLang capture the step in
CUDA graphs, replayed with one launch. A graph replays fixed kernels on fixed addresses, so
everything the step reads and writes lives in static buffers here:

- the KV cache: per layer keys and values [R, kv heads, C, D], zero-initialised (masked columns hold
  finite numbers: softmax's zero weight times a NaN would still be NaN);
- the inputs: token ids [R], positions [R], the rows' real columns ``valid`` [R, C], the column the
  new token is written at (a one-element tensor: :func:`moectl.lm.decode_step.decode_step`'s
  ``column``), each masked MoE layer's allowed experts [R, E];
- one graph per (rows bucket, columns bucket, masked layers, renorm): rows padded up to a power of
  two (pad rows attend to their column 0 only and are dropped from the outputs), columns to a power
  of two from 64 (attention reads the bucket's columns, masked past the rows' ends).

The engine keeps handling the cache as a ``DynamicCache``: after a step its layers are views of the
static buffers' first B rows and T + 1 columns; where a layer no longer holds the view the last step
left (the engine re-batched, trimmed or extended it), it is copied in again (from a copy where it is
itself a view of the buffers). Only one cache lives in the buffers at a time: a step for another
cache first hands the previous one its own copy, so nothing the engine holds is overwritten.

``capture=False`` (the default off CUDA) runs the same static step eagerly: the CPU twin the tests
compare with the model's forward and the compiled step, through the engine with rows joining and
leaving. On CUDA the capture follows PyTorch's recipe (two warm-up runs on a side stream, then
``torch.cuda.graph`` into one memory pool shared by all graphs, as they never run concurrently).
The experts' grouped products on CUDA count each expert's rows without a host read
(``models.grouped_mm.group_by_expert``), so the large-experts call captures too. Never run on a GPU
(docs/gpu.md): the CUDA path ships with its CPU twin tested.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from moectl.lm.attention import attention_kernels
from moectl.lm.compiled_decode import StepResult, plain_cache
from moectl.lm.decode_step import StepWeights, decode_step

log = logging.getLogger("moectl.engine")

FIRST_COLUMNS = 64  # the smallest columns bucket


def buckets(first: int, limit: int) -> list[int]:
    """Powers of two from ``first`` below ``limit``, then ``limit``: the sizes graphs are built for."""
    sizes, size = [], first
    while size < limit:
        sizes.append(size)
        size *= 2
    return [*sizes, limit]


def bucket(sizes: Sequence[int], n: int) -> int:
    """The smallest of ``sizes`` holding ``n`` (the caller has checked that one does)."""
    return next(s for s in sizes if s >= n)


@dataclass
class StaticBuffers:
    """Everything the captured step reads and writes (see the module doc)."""

    keys: list[Tensor]  # per layer [R, kv heads, C, D]
    values: list[Tensor]
    ids: Tensor  # [R]
    positions: Tensor  # [R]
    valid: Tensor  # [R, C] bool
    column: Tensor  # [1]: the column this step writes
    allowed: list[Tensor]  # per MoE layer [R, E] bool


@dataclass
class Graph:
    """One captured step (``graph`` None on the CPU twin: ``run`` is then called each time) and its outputs."""

    run: Callable[[], tuple[Tensor, Tensor, Tensor, Tensor]]
    graph: Any
    outputs: tuple[Tensor, Tensor, Tensor, Tensor] | None


class GraphDecode:
    """One token per row through :func:`decode_step` over static buffers (see the module doc).

    ``max_rows`` and ``max_len``: the largest batch and cache (columns, this token's included) the
    buffers hold; a step beyond either takes a slower path (:meth:`covers` names why)."""

    def __init__(self, weights: StepWeights, max_rows: int, max_len: int, capture: bool | None = None) -> None:
        self.weights = weights
        self.device = weights.embed.device
        self.captured = self.device.type == "cuda" if capture is None else capture
        self.rows = buckets(1, max_rows)
        self.columns = buckets(min(FIRST_COLUMNS, max_len), max_len)
        self.compiles = 0  # graphs built
        self.compile_seconds = 0.0
        self.copies_in = 0  # caches copied into the buffers (a new batch, a trimmed or extended cache)
        self._graphs: dict[tuple, Graph] = {}
        self._buffers: StaticBuffers | None = None
        self._views: list[tuple[Tensor, Tensor]] = []  # the views the last step left in its cache
        self._owner: weakref.ref | None = None  # that cache
        self._pool = None

    def buffers(self) -> StaticBuffers:
        """The static buffers, allocated at the first use (a few GB at OLMoE's width on a GPU)."""
        if self._buffers is None:
            w, r, c = self.weights, self.rows[-1], self.columns[-1]
            kv = [torch.zeros(r, w.num_kv_heads, c, w.head_dim, dtype=w.dtype, device=self.device)
                  for _ in range(2 * len(w.layers))]  # fmt: skip
            moe = sum(layer.moe_index is not None for layer in w.layers)
            self._buffers = StaticBuffers(
                keys=kv[0::2], values=kv[1::2],
                ids=torch.zeros(r, dtype=torch.long, device=self.device),
                positions=torch.zeros(r, dtype=torch.long, device=self.device),
                valid=torch.zeros(r, c, dtype=torch.bool, device=self.device),
                column=torch.zeros(1, dtype=torch.long, device=self.device),
                allowed=[torch.ones(r, max(w.num_experts, 1), dtype=torch.bool, device=self.device)
                         for _ in range(moe)],
            )  # fmt: skip
        return self._buffers

    def covers(self, cache: Any) -> str | None:
        """None where this step can extend ``cache``, else why not."""
        why = plain_cache(cache, len(self.weights.layers))
        if why is not None:
            return why
        rows, columns = cache.layers[0].keys.shape[0], cache.layers[0].keys.shape[2] + 1
        if rows > self.rows[-1]:
            return f"more rows than the CUDA graphs' largest batch ({self.rows[-1]})"
        if columns > self.columns[-1]:
            return f"a cache longer than the CUDA graphs' buffers ({self.columns[-1]} columns)"
        return None

    def warm_up(self, threads: Sequence[int] = ()) -> float:
        """Capture the graphs of unmasked steps for every bucket now (CUDA), so requests do not wait
        for captures; the seconds it took. ``threads`` is :class:`CompiledDecode`'s argument (CPU
        thread counts), unused here. The CPU twin allocates its buffers only."""
        del threads
        start = time.perf_counter()
        s = self.buffers()
        if self.captured:
            with torch.inference_mode(), attention_kernels(self.device):
                self._detach_owner()
                s.valid.zero_()
                s.valid[:, 0] = True  # no row without a real column (its attention would be NaN)
                s.column.zero_()
                for b in self.rows:
                    for c in self.columns:
                        self._graph(b, c, None, "pruned")
        return time.perf_counter() - start

    def __call__(
        self, last: Tensor, valid: Tensor, positions: Tensor, cache: Any,
        allowed: list[Tensor | None] | None = None, renorm: str = "pruned",
    ) -> StepResult:  # fmt: skip
        """The step after ``last`` [B] (:class:`StepResult`); ``cache`` extended by one column.
        Arguments as :meth:`moectl.lm.compiled_decode.CompiledDecode.__call__`."""
        s = self.buffers()
        n, t = last.shape[0], valid.shape[1] - 1
        b, c = bucket(self.rows, n), bucket(self.columns, t + 1)
        self._load(cache, n, t)
        s.ids[:n].copy_(last)
        s.ids[n:b].zero_()
        s.positions[:n].copy_(positions.reshape(-1))
        s.positions[n:b].zero_()
        s.valid[:b, :c].zero_()
        s.valid[:n, : t + 1].copy_(valid)
        s.valid[n:b, 0] = True  # pad rows attend to their column 0 (finite, dropped)
        s.column.fill_(t)
        pattern = None if allowed is None else tuple(m is not None for m in allowed)
        for j, mask in enumerate(allowed or ()):
            if mask is not None:
                s.allowed[j][:n].copy_(mask)
                s.allowed[j][n:b] = True
        graph = self._graph(b, c, pattern, renorm)
        if graph.graph is not None:
            graph.graph.replay()
            outputs = graph.outputs
        else:
            outputs = graph.run()
        assert outputs is not None
        logits, chosen, greedy, omega = outputs
        result = StepResult(logits[:n].clone(), chosen[:, :n].clone(), greedy[:n].clone(), omega[:n].clone())
        self._advance(cache, n, t + 1)
        return result

    def _graph(self, b: int, c: int, pattern: tuple[bool, ...] | None, renorm: str) -> Graph:
        key = (b, c, pattern, renorm)
        graph = self._graphs.get(key)
        if graph is None:
            start = time.perf_counter()
            graph = self._build(b, c, pattern, renorm)
            self._graphs[key] = graph
            self.compiles += 1
            self.compile_seconds += time.perf_counter() - start
            if self.captured:
                log.info("captured the decoding step for %d rows, %d columns in %.2f s", b, c,
                         time.perf_counter() - start)  # fmt: skip
        return graph

    def _build(self, b: int, c: int, pattern: tuple[bool, ...] | None, renorm: str) -> Graph:
        """The step over the buffers' first ``b`` rows and ``c`` columns, captured where ``captured``."""
        s = self.buffers()
        keys = [k.narrow(0, 0, b).narrow(2, 0, c) for k in s.keys]
        values = [v.narrow(0, 0, b).narrow(2, 0, c) for v in s.values]
        allowed = None if pattern is None else [m.narrow(0, 0, b) if on else None for m, on in zip(s.allowed, pattern, strict=True)]
        ids, positions, valid = s.ids.narrow(0, 0, b), s.positions.narrow(0, 0, b), s.valid[:b, :c]

        def run() -> tuple[Tensor, Tensor, Tensor, Tensor]:
            return decode_step(self.weights, ids, positions, valid, keys, values, allowed, renorm, column=s.column)

        if not self.captured:
            return Graph(run, None, None)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # lazy initialisations (cuBLAS handles, workspaces) outside the capture
            for _ in range(2):
                run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = run()
        return Graph(run, graph, outputs)

    def _load(self, cache: Any, n: int, t: int) -> None:
        """The cache's first ``t`` columns of ``n`` rows into the buffers, unless they are the views
        the last step left there (see the module doc)."""
        layers = cache.layers
        owner = self._owner() if self._owner is not None else None
        if owner is cache and all(
            layer.keys is k and layer.values is v for layer, (k, v) in zip(layers, self._views, strict=True)
        ):
            return
        if owner is not None and owner is not cache:
            self._detach_owner()
        s = self.buffers()
        for layer, k, v in zip(layers, s.keys, s.values, strict=True):
            for src, dst in ((layer.keys, k), (layer.values, v)):
                if src.untyped_storage().data_ptr() == dst.untyped_storage().data_ptr():
                    src = src.clone()  # a view of the buffers (a trimmed cache): copied out first
                dst[:n, :, :t].copy_(src)
        self.copies_in += 1

    def _advance(self, cache: Any, n: int, length: int) -> None:
        s = self.buffers()
        self._views = []
        for layer, k, v in zip(cache.layers, s.keys, s.values, strict=True):
            layer.keys, layer.values = k[:n, :, :length], v[:n, :, :length]
            self._views.append((layer.keys, layer.values))
        self._owner = weakref.ref(cache)

    def _detach_owner(self) -> None:
        """Give the cache that lives in the buffers its own copy of the views it holds, before the
        buffers take another cache (or a warm-up's captures write into them)."""
        owner = self._owner() if self._owner is not None else None
        if owner is not None and self._buffers is not None:
            ours = {t.untyped_storage().data_ptr() for t in (*self._buffers.keys, *self._buffers.values)}
            for layer in owner.layers:  # the views the last step left, and any view of them since
                if layer.keys.untyped_storage().data_ptr() in ours:
                    layer.keys = layer.keys.clone()
                if layer.values.untyped_storage().data_ptr() in ours:
                    layer.values = layer.values.clone()
        self._owner, self._views = None, []
