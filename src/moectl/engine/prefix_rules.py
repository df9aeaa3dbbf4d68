"""Which requests may use the prompt-prefix cache (``prefix_cache.py``), and storing their prompts' KV.

A prompt's KV may be stored and reused where it depends on the tokens alone: the model's own
routing or a routing shared by every request (keyed by the routing's name), one row per request,
nothing recorded (a recorded prompt's routing is recorded by its own prefill), no offloading
residency (its routing follows the resident set), not the solo mode, and cache layers that can be
cut by column (checked at the first store: ``prefix_cache.supports``). The scheduler asks
:meth:`lookup` / :meth:`key`; the engine's prefill offers each prompt's KV through :meth:`store`.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from moectl.engine.prefix_cache import Prefix, PrefixCache, supports


class PrefixRules:
    """The prefix cache as the engine's scheduler and prefill use it (see the module doc)."""

    def __init__(self, cache: PrefixCache, *, record: bool, solo: bool) -> None:
        self.cache = cache
        self.record, self.solo = record, solo
        self.residency = False  # an offloading runtime routes by its resident set (set when the engine opens)
        self.supported = True  # the model's cache layers allow prefixes (checked at the first store)

    @property
    def max_tokens(self) -> int:
        return self.cache.max_tokens

    def key(self, req: Any) -> tuple[bool, str | None]:
        """(whether ``req``'s prompt KV may be stored and reused, the key it is stored under)."""
        routing = req.routing
        ok = (
            self.cache.max_tokens > 0
            and self.supported
            and not self.residency
            and not self.record
            and req.trace is None
            and not self.solo
            and req.copies == 1
            and (routing is None or (routing.roe is None and not routing.per_request and routing.row_codes is None))
        )
        return ok, None if routing is None else routing.name

    def lookup(self, req: Any) -> Prefix | None:
        """The longest stored prefix of ``req``'s prompt it may use (never an echo request's: it
        needs every prompt position's hidden state)."""
        if req.params.prompt_logprobs is not None:
            return None
        ok, key = self.key(req)
        return self.cache.lookup(key, req.prompt) if ok else None

    def twin_key(self, req: Any) -> tuple[str | None, tuple[int, ...]] | None:
        """The (key, prompt) under which ``req``'s whole prompt will be stored, where it will be."""
        ok, key = self.key(req)
        cacheable = ok and req.params.prompt_logprobs is None and len(req.prompt) <= self.cache.max_tokens
        return (key, tuple(req.prompt)) if cacheable else None

    def store(self, req: Any, cache: Any, row: int, cols: Tensor) -> None:
        """Offer row ``row``'s prompt KV (its real columns ``cols`` [L] bool) to the prefix cache."""
        if self.cache.max_tokens == 0 or not self.supported:
            return
        if not supports(cache):
            self.supported = False
            return
        ok, key = self.key(req)
        if ok and len(req.prompt) <= self.cache.max_tokens:
            cols = cols.to(cache.layers[0].keys.device)
            layers = [(x.keys[row : row + 1, :, cols].clone(), x.values[row : row + 1, :, cols].clone())
                      for x in cache.layers]  # fmt: skip
            self.cache.store(key, req.prompt, layers)
