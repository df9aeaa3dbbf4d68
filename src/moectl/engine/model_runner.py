"""The model runner: the one place the engine calls the model, one forward per call.

A prefill forward is the model's own (transformers' forward over many tokens per row). A decoding
forward (one token per row) runs the lean forward of ``moectl.lm.lean_decode`` where the model's
family has one and the call is one it computes exactly as the model's: the same modules and
operations without transformers' per-layer plumbing (the reference model, one row, 2 threads:
``benchmarks/engine_step_split.py``). Routing, recording, offloading and padding skips act on the
routers and experts modules, which both forwards call the same way.

``EngineConfig.lean_decode=False`` (``moectl serve --no-lean-decode``) keeps the model's own
forward everywhere; ``ModelRunner.path`` says which forward decodes and, where it is the model's,
why (logged once).
"""

from __future__ import annotations

import logging
from typing import Any

from torch import Tensor, nn

from moectl.lm.lean_decode import LeanDecode, lean_decode
from moectl.routing.kv_cache import cache_out, with_cache

log = logging.getLogger("moectl.engine")


class ModelRunner:
    """Prefill and decode forwards of ``model`` for the engine (see the module doc)."""

    def __init__(self, model: nn.Module, lean: bool = True) -> None:
        self.model = model
        self.lean: LeanDecode | None = None
        if lean:
            self.lean, why = lean_decode(model)
        else:
            why = "lean decoding switched off (lean_decode=False)"
        self.path = why
        self.calls: dict[str, int] = {}  # decoding forwards by path: {"lean": n, "model": m}
        if self.lean is None:
            log.info("decoding through the model's own forward: %s", why)

    def prefill(self, ids: Tensor, mask: Tensor, positions: Tensor, cache: Any) -> tuple[Tensor, Any]:
        """The last position's logits [B, V] and the cache after ``ids`` [B, T]."""
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, **with_cache(cache),
                         use_cache=True, logits_to_keep=1)  # fmt: skip
        return out.logits[:, -1], cache if cache_out(out) is None else cache_out(out)

    def decode(self, last: Tensor, mask: Tensor, positions: Tensor, cache: Any) -> tuple[Tensor, Any]:
        """The logits [B, V] after one token per row (``last`` [B]) and the cache extended by it."""
        if self.lean is None:
            self.calls["model"] = self.calls.get("model", 0) + 1
            return self.prefill(last[:, None], mask, positions, cache)
        with self.lean.installed(self.calls):
            return self.prefill(last[:, None], mask, positions, cache)
