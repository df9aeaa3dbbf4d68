"""The decoding step compiled whole: one graph per batch shape class, no Python per layer at run time.

:class:`CompiledDecode` runs :func:`moectl.lm.decode_step.decode_step` through ``torch.compile``
(inductor; on the CPU it generates C++ for the step's small operations, which the eager step spends
most of its time dispatching: issue 39 item 3). The cache stays the engine's ``DynamicCache``: its
layers' keys and values are views of buffers with free columns (``moectl.lm.kv_buffers``), which
the step writes in place, not concatenated onto as ``DynamicLayer.update`` does. Rows join and
leave and the cache grows at every step, so the batch size, the cache length and the buffers'
columns are marked dynamic: one graph serves every length, and batch sizes take two (one row, and
several: ``torch.compile`` specialises a size of 1). ``compiles`` counts the
graphs built; ``benchmarks/engine_compiled.py`` measures what they cost as rows join and leave.

``compile=False`` runs the same step eagerly (its CPU twin in tests, and the path where
``torch.compile`` is unavailable). On a GPU the same graph is what ``mode="reduce-overhead"`` would
capture in CUDA graphs; that path has never run here (docs/gpu.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from moectl.lm.decode_step import StepWeights, decode_step, sums_for
from moectl.lm.kv_buffers import advance, buffers

log = logging.getLogger("moectl.engine")


def compile_options(weights: StepWeights, mode: str | None) -> dict[str, Any]:
    """``torch.compile``'s mode or options for the step. On the CPU, inductor's C++ wrapper
    (``cpp_wrapper``): the generated kernels are called from C++, not from a Python wrapper, which
    a small model's step spends a part of its time in. Measured in one process, interleaved, 5
    rounds (``benchmarks/engine_compiled.py --cpp-wrapper-ab``, reference model, one thread): quiet
    (load 0.6) 1 row 292.9 against 279.3 tok/s (1.05x), 8 rows 1019.6 against 972.7 (1.05x); at load
    ~3.5, 1.11x and 1.09x."""
    if mode is not None:
        return {"mode": mode}
    return {"options": {"cpp_wrapper": True}} if weights.embed.device.type == "cpu" else {}


def plain_cache(cache: Any, layers: int) -> str | None:
    """None where ``cache`` is a ``DynamicCache`` of ``layers`` plain, filled layers (what the step
    extends), else what it is instead."""
    from transformers.cache_utils import DynamicLayer

    found = getattr(cache, "layers", None)
    if found is None or len(found) != layers:
        return "not a DynamicCache of every layer"
    if any(type(layer) is not DynamicLayer or not layer.is_initialized for layer in found):
        return "cache layers that are not plain, filled DynamicLayers"
    return None


class StepResult(NamedTuple):
    """What one compiled step gives: the logits [B, V], the experts chosen [L, B, k], the greedy
    tokens [B] (the logits' argmax) and the same choices as ω [B, L, E] bool (the switch counts)."""

    logits: Tensor
    chosen: Tensor
    greedy: Tensor
    omega: Tensor


class CompiledDecode:
    """One token per row through :func:`decode_step`, compiled (see the module doc)."""

    def __init__(self, weights: StepWeights, compile: bool = True, mode: str | None = None) -> None:
        self.weights = weights
        self.compiled = compile
        self.compiles = 0  # graphs built (first calls of a new shape class)
        self.compile_seconds = 0.0
        self._shapes: set[tuple] = set()  # graph classes seen: one row / several, the masked layers
        self._fn = torch.compile(self._step, dynamic=None, **compile_options(weights, mode)) if compile else self._step

    def _step(self, ids: Tensor, positions: Tensor, valid: Tensor, keys: list[Tensor], values: list[Tensor],
              allowed: list[Tensor | None] | None, renorm: str, sums: bool):  # fmt: skip
        return decode_step(self.weights, ids, positions, valid, keys, values, allowed, renorm, sums)

    def warm_up(self, threads: Sequence[int] = ()) -> float:
        """Build both graphs now (one row, two rows) on an empty-ish cache, so the first requests do
        not wait for the compiler; the seconds it took. ``threads``: the torch thread counts the
        steps will run with (default: this thread's): dynamo guards on the count (inductor's kernels
        are generated for it), so a graph built with another count is built again at the first
        step (``moectl serve`` loaded and warmed up with one thread, then stepped with two: both
        graphs compiled again under its first requests)."""
        from transformers import DynamicCache

        w = self.weights
        start = time.perf_counter()
        device = w.embed.device
        before = torch.get_num_threads()
        try:
            for count in threads or (before,):
                torch.set_num_threads(count)
                with torch.inference_mode():  # as the engine steps: its caches are inference tensors (a guard)
                    for rows in (1, 2):
                        cache = DynamicCache()
                        for i in range(len(w.layers)):
                            kv = torch.zeros(rows, w.num_kv_heads, 4, w.head_dim, dtype=w.dtype, device=device)
                            cache.update(kv, kv.clone(), i)
                        valid = torch.ones(rows, 5, dtype=torch.bool, device=device)
                        positions = torch.full((rows, 1), 4, dtype=torch.long, device=device)
                        self(torch.zeros(rows, dtype=torch.long, device=device), valid, positions, cache)
        finally:
            torch.set_num_threads(before)
        return time.perf_counter() - start

    def covers(self, cache: Any) -> str | None:
        """None where this step can extend ``cache``, else why not."""
        return plain_cache(cache, len(self.weights.layers))

    def __call__(
        self, last: Tensor, valid: Tensor, positions: Tensor, cache: Any,
        allowed: list[Tensor | None] | None = None, renorm: str = "pruned",
    ) -> StepResult:  # fmt: skip
        """The step after ``last`` [B] (:class:`StepResult`); ``cache`` extended.

        ``valid`` [B, T + 1] marks each row's real columns after this token; ``positions`` [B, 1]
        or [B] each row's position; ``allowed``, ``renorm``: the rows' expert masks per MoE layer
        (:func:`decode_step`). Masks make a graph of their own (which layers have one)."""
        keys, values = buffers(cache)  # each layer's buffer, a free column at T (``kv_buffers``)
        positions = positions.reshape(-1)
        valid = valid.bool()
        sums = sums_for(last.shape[0], torch.get_num_threads())
        shape = (last.shape[0] > 1, None if allowed is None else tuple(m is not None for m in allowed), renorm, sums,
                 torch.get_num_threads())  # fmt: skip  (dynamo guards on the count: a graph per count)
        first = self.compiled and shape not in self._shapes
        if first:  # marks matter only where a graph is built; later calls match its symbolic sizes
            for t in (*keys, *values):
                torch._dynamo.maybe_mark_dynamic(t, 2)
                if t.shape[0] > 1:
                    torch._dynamo.maybe_mark_dynamic(t, 0)
            torch._dynamo.maybe_mark_dynamic(valid, 1)
            if last.shape[0] > 1:
                for t in (last, positions, valid, *(m for m in allowed or () if m is not None)):
                    torch._dynamo.maybe_mark_dynamic(t, 0)
        start = time.perf_counter()
        result = StepResult(*self._fn(last, positions, valid, keys, values, allowed, renorm, sums))
        if first:
            self._shapes.add(shape)
            self.compiles += 1
            self.compile_seconds += time.perf_counter() - start
            log.info("compiled the decoding step for %s in %.1f s", "several rows" if shape[0] else "one row",
                     time.perf_counter() - start)  # fmt: skip
        advance(cache, keys, values, valid.shape[1])
        return result
