"""The model runner: the one place the engine calls the model, one forward per call.

A prefill forward is the model's own (transformers' forward over many tokens per row). A decoding
forward (one token per row) takes the fastest path that computes it as the model would:

1. ``compiled``: the whole step as one ``torch.compile`` graph (``moectl.lm.compiled_decode``), for
   OLMoE, Qwen2-MoE, Qwen3-MoE and Mixtral with plain experts, where every row of the step is routed
   as the model routes it or by an expert mask (a subset) and nothing records the step (the engine
   says so: ``decode(plain=..., allowed=...)``).
   It bypasses the modules' hooks, so it returns the experts it chose for the switch counts.
2. ``lean``: ``moectl.lm.lean_decode``, the same modules and operations without transformers'
   per-layer plumbing; routing, recording, offloading and padding skips act on the routers and
   experts modules, which it calls as the model's forward does.
3. ``model``: the model's own forward, for everything else.

On CUDA path 1 is the same step over static buffers replayed as CUDA graphs
(``moectl.lm.graph_decode``; ``EngineConfig.graph_decode``, on by default there; never run on a
GPU yet), ``graphs`` giving the largest batch and cache its buffers hold.

``EngineConfig.compile_decode`` switches path 1 on (``moectl serve`` does by default),
``EngineConfig.lean_decode=False`` (``--no-lean-decode``) keeps path 3 everywhere. ``path`` says
which decodes and why not a faster one (logged once); ``calls`` counts forwards by path and
``slow`` counts, by reason, the steps a compiled runner left to a slower path.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import Tensor, nn

from moectl.lm.compiled_decode import CompiledDecode, StepResult
from moectl.lm.graph_decode import GraphDecode
from moectl.lm.kv_buffers import release
from moectl.lm.lean_decode import LeanDecode, lean_decode
from moectl.routing.kv_cache import cache_out, with_cache

log = logging.getLogger("moectl.engine")


class ModelRunner:
    """Prefill and decode forwards of ``model`` for the engine (see the module doc)."""

    def __init__(
        self, model: nn.Module, lean: bool = True, compile: bool = False, info: Any = None,
        graphs: tuple[int, int] | None = None,
    ) -> None:  # fmt: skip
        self.model = model
        self.lean: LeanDecode | None = None
        self.compiled: CompiledDecode | GraphDecode | None = None
        if lean:
            self.lean, why = lean_decode(model)
        else:
            why = "lean decoding switched off (lean_decode=False)"
        if lean and compile:
            from moectl.lm.step_weights import step_weights

            weights, reason = step_weights(model, info)
            if weights is not None and graphs is not None:
                self.compiled = GraphDecode(weights, *graphs)
                kind = "CUDA graphs" if self.compiled.captured else "static buffers, uncaptured (the CPU twin)"
                why = f"{reason}; over {kind}, up to {graphs[0]} rows and {graphs[1]} columns"
            elif weights is not None:
                self.compiled = CompiledDecode(weights)
                why = reason
            else:
                why = f"{why}; no compiled step: {reason}"
        self.path = why
        self.calls: dict[str, int] = {}  # decoding forwards by path: {"compiled": n, "lean": m, "model": k}
        self.slow: dict[str, int] = {}  # decoding steps a compiled runner left to a slower path, by reason
        self.result: StepResult | None = None  # the latest decoding step's, where it ran compiled
        self.reason: str | None = None  # why the latest decoding step did not run compiled (with one)
        if self.lean is None or (compile and self.compiled is None):
            log.info("decoding path: %s", why)

    def prefill(self, ids: Tensor, mask: Tensor, positions: Tensor, cache: Any) -> tuple[Tensor, Any]:
        """The last position's logits [B, V] and the cache after ``ids`` [B, T]."""
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, **with_cache(cache),
                         use_cache=True, logits_to_keep=1)  # fmt: skip
        return out.logits[:, -1], cache if cache_out(out) is None else cache_out(out)

    def decode(
        self, last: Tensor, mask: Tensor, positions: Tensor, cache: Any, plain: str | None = "not asked",
        allowed: list[Tensor | None] | None = None, renorm: str = "pruned",
    ) -> tuple[Tensor, Any]:  # fmt: skip
        """The logits [B, V] after one token per row (``last`` [B]) and the cache extended by it;
        ``mask`` [B, T + 1] the rows' real columns (bool or 0/1).

        ``plain`` is None where the compiled step may run: every row routed as the model routes it
        or by an expert mask (``allowed``, ``renorm``: ``decode_step``), nothing recording the step;
        else the reason it may not. After a compiled step ``result`` holds what it gave
        (``StepResult``: the experts it chose, its greedy tokens, ω; None after any other path)."""
        self.result = self.reason = None
        if self.compiled is not None:
            why = plain or self.compiled.covers(cache) or self._hooked()
            self.reason = why
            if why is None:
                try:
                    self.result = self.compiled(last, mask, positions, cache, allowed, renorm)
                except Exception as err:  # a compiler failure (no C++ compiler, an inductor error): the
                    self.disable(err)  # step wrote only past the cache's end, so the lean forward takes it
                else:
                    self.calls["compiled"] = self.calls.get("compiled", 0) + 1
                    return self.result.logits, cache
            self.slow[why] = self.slow.get(why, 0) + 1
            release(cache)  # the step's cache buffers, if it had any: this forward concatenates
        mask = mask.long()  # the model's forward takes a 0/1 mask (the compiled step a bool one)
        if self.lean is None:
            self.calls["model"] = self.calls.get("model", 0) + 1
            return self.prefill(last[:, None], mask, positions, cache)
        with self.lean.installed(self.calls):
            return self.prefill(last[:, None], mask, positions, cache)

    def disable(self, err: BaseException) -> None:
        """Stop using the compiled step after it failed (logged once; ``path`` says why)."""
        self.compiled = None
        self.reason = None
        self.path = f"{self.path}; the compiled step failed, decoding lean: {type(err).__name__}: {err}"
        log.warning("decoding path: %s", self.path)

    def _hooked(self) -> str | None:
        """Why the compiled step may not run for hooks someone put on the decoder (it would skip them)."""
        if self.lean is not None and self.lean._hooked():
            return "hooks on decoder layers or attention modules"
        return None
