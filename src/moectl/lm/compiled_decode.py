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

After its first step, each graph class is called without dynamo's guard check: the graph dynamo
built for it (its cache entry, found by its own guards once) is run directly. The class key here
already holds everything the guards would tell apart (one row or several, which layers have masks,
the renormalisation, sums or products, the thread count, ``decode_step``'s settings), the cache
buffers always leave a free column (``kv_buffers``), and the inputs' dtypes and layouts are checked
here first (a call that fails the check takes the guarded call). Dynamo's check at every call cost
0.1-0.15 ms of a 1.1-1.6 ms step on the reference model (``benchmarks/step_ways.py --setting guards``
on an AMD EPYC: 1.08x at one row on one thread, 1.13x on two, 1.05-1.06x at 8 rows). ``guards=True`` keeps dynamo's own
check; a PyTorch without the cache entries to run keeps it too.

``compile=False`` runs the same step eagerly (its CPU twin in tests, and the path where
``torch.compile`` is unavailable). On a GPU the same graph is what ``mode="reduce-overhead"`` would
capture in CUDA graphs; that path has never run here (docs/gpu.md).
"""

from __future__ import annotations

import inspect
import logging
import time
import types
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from moectl.lm import decode_step as step_module
from moectl.lm.decode_step import StepWeights, decode_step, sums_for
from moectl.lm.kv_buffers import advance, buffers
from moectl.lm.step_modules import ModuleCall

log = logging.getLogger("moectl.engine")


def compile_options(weights: StepWeights, mode: str | None) -> dict[str, Any]:
    """``torch.compile``'s mode or options for the step. On the CPU, inductor's C++ wrapper
    (``cpp_wrapper``): the generated kernels are called from C++, not from a Python wrapper, which
    a small model's step spends a part of its time in. Measured in one process, interleaved, 5
    rounds (``benchmarks/engine_compiled.py --cpp-wrapper-ab``, reference model, one thread): quiet
    (load 0.6) 1 row 292.9 against 279.3 tok/s (1.05x), 8 rows 1019.6 against 972.7 (1.05x); at load
    ~3.5, 1.11x and 1.09x. A step that calls layers as they are (quantized ones: ``step_modules``)
    keeps the Python wrapper: the C++ one releases the GIL and takes it back for each such call, and
    beside a server's other threads each take could wait (one client's int4 OLMoE step 65 ms, not 40)."""
    if mode is not None:
        return {"mode": mode}
    if weights.embed.device.type != "cpu" or module_calls(weights):
        return {}
    return {"options": {"cpp_wrapper": True}}


def module_calls(weights: StepWeights) -> int:
    """How many layers the step calls as they are (``moectl.lm.step_modules``)."""
    parts = [weights.lm_head]
    for w in weights.layers:
        parts += [w.q, w.k, w.v, w.o, w.experts_call, w.shared_gate, *(w.shared or ()), *(w.dense or ())]
    return sum(isinstance(p, ModuleCall) for p in parts)


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

    def __init__(self, weights: StepWeights, compile: bool = True, mode: str | None = None, guards: bool = False) -> None:
        self.weights = weights
        self.compiled = compile
        self.guards = guards  # dynamo's guard check at every step (False: the class key and ``_unguarded_inputs``)
        self.compiles = 0  # graphs built (first calls of a new shape class)
        self.compile_seconds = 0.0
        self._shapes: set[tuple] = set()  # graph classes seen: one row / several, the masked layers
        self._fn = torch.compile(self._step, dynamic=None, **compile_options(weights, mode)) if compile else self._step
        self._unguarded: dict[tuple, Any] = {}  # graph class -> dynamo's code for it, called unguarded

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
        last, positions, valid = last.contiguous(), positions.reshape(-1).contiguous(), valid.bool().contiguous()
        sums = sums_for(last.shape[0], torch.get_num_threads())
        shape = (last.shape[0] > 1, None if allowed is None else tuple(m is not None for m in allowed), renorm, sums,
                 torch.get_num_threads(), step_module.ATTENTION, step_module.SMALL_PRODUCTS)  # fmt: skip
        # (dynamo guards on the thread count: a graph per count; the module's settings are traced in)
        first = self.compiled and (shape, self.guards) not in self._shapes  # (a graph of each way)
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
        args = (last, positions, valid, keys, values, allowed, renorm, sums)
        unguarded = None if self.guards else self._unguarded.get(shape)
        if unguarded is not None and self._unguarded_inputs(last, positions, valid, keys, values, allowed):
            result = StepResult(*unguarded(self, *args))
        else:
            result = StepResult(*self._fn(*args))
            if self.compiled and not self.guards and shape not in self._unguarded:
                self._unguarded[shape] = self._cached_code(args)
        if first:
            self._shapes.add((shape, self.guards))
            self.compiles += 1
            self.compile_seconds += time.perf_counter() - start
            log.info("compiled the decoding step for %s in %.1f s", "several rows" if shape[0] else "one row",
                     time.perf_counter() - start)  # fmt: skip
        advance(cache, keys, values, valid.shape[1])
        return result

    def _cached_code(self, args: tuple) -> Any:
        """Dynamo's code for ``args``' graph class (the cache entry of ``_step`` whose guards pass for
        them, right after the guarded call that built or found it) as a function of ``_step``'s
        arguments; None where this PyTorch has no such entries (the guarded call then serves the class)."""
        try:
            from torch._dynamo.eval_frame import _debug_get_cache_entry_list

            step = CompiledDecode._step
            frame = dict(zip(inspect.signature(step).parameters, (self, *args), strict=True))
            for entry in _debug_get_cache_entry_list(step.__code__):
                if entry.guard_manager.check(frame):
                    return types.FunctionType(entry.code, step.__globals__, "unguarded_step")
        except Exception as err:  # (private to dynamo: a PyTorch without it keeps the guards)
            log.info("the decoding step keeps dynamo's guard check (%s: %s)", type(err).__name__, err)
        return None

    def _unguarded_inputs(self, last: Tensor, positions: Tensor, valid: Tensor, keys: list[Tensor],
                          values: list[Tensor], allowed: list[Tensor | None] | None) -> bool:  # fmt: skip
        """What dynamo's guards would check beyond the class key: dtypes, devices and contiguous
        layouts of the inputs (the graph's generated code indexes them as it traced them)."""
        device, dtype = self.weights.embed.device, self.weights.dtype
        if last.dtype != torch.long or positions.dtype != torch.long or valid.dtype != torch.bool:
            return False
        if not (last.is_contiguous() and positions.is_contiguous() and valid.is_contiguous()):
            return False
        if last.device != device or valid.device != device:
            return False
        for t in (*keys, *values):
            if t.dtype != dtype or t.device != device or not t.is_contiguous():
                return False
        return all(m.dtype == torch.bool and m.is_contiguous() for m in allowed or () if m is not None)
