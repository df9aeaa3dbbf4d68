"""Prompt-prefix reuse: the KV cache of earlier prompts, so a new prompt that starts the same way
prefills only what differs (what llama-server's ``cache_prompt`` and vLLM's prefix caching do).

An entry is one prefilled prompt: its token ids and, per attention layer, its keys and values
[1, H, n, D], stored under a routing key. A prompt's keys and values at position t depend on its
tokens up to t and on how each MoE layer routed them, so an entry is reused only under the same
key, and only for routings whose result is a function of the tokens alone (the engine passes no
key, and stores nothing, for routings with per-request state — Gumbel noise, document pools,
controllers —, RoE, residency policies that reroute tokens, and recorded traces). A lookup
returns the longest stored prefix of the prompt's tokens but its last (the forward must see at
least one token to give the next-token distribution). Entries are evicted least recently used
first once their tokens pass ``max_tokens``; a lookup's tensors are views of the stored ones
(a forward appends with ``torch.cat`` and never writes into them).

Models with sliding-window or other non-full-attention cache layers keep no prefix (a window
drops the columns a shorter prefix would need): ``supports`` says whether a cache qualifies.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from torch import Tensor

from moectl.errors import ConfigError


@dataclass
class Prefix:
    """A stored prompt's first ``length`` tokens: per layer (keys, values) [1, H, length, D]."""

    length: int
    layers: list[tuple[Tensor, Tensor]]


def supports(cache) -> bool:
    """Whether every layer of ``cache`` is a full-attention ``DynamicLayer`` (see the module doc)."""
    from transformers.cache_utils import DynamicLayer

    return all(
        type(layer) is DynamicLayer and not getattr(layer, "is_sliding", False) for layer in cache.layers
    )


class PrefixCache:
    """Stored prompt prefixes under routing keys, at most ``max_tokens`` tokens in all (LRU)."""

    def __init__(self, max_tokens: int) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise ConfigError(f"prefix cache size must be an integer >= 0 tokens, got {max_tokens!r}")
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[Hashable, tuple[int, ...]], list[tuple[Tensor, Tensor]]] = (
            OrderedDict()
        )
        self.tokens = 0
        self.hits = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, key: Hashable, ids: Sequence[int]) -> Prefix | None:
        """The longest stored prefix of ``ids[:-1]`` under ``key`` (None: none of at least one token)."""
        if not self._entries:
            return None
        wanted = tuple(ids[:-1])
        best, best_len = None, 0
        for entry_key in self._entries:
            k, stored = entry_key
            if k != key:
                continue
            n = _common(stored, wanted)
            if n > best_len:
                best, best_len = entry_key, n
        if best is None:
            return None
        self._entries.move_to_end(best)
        self.hits += 1
        self.reused_tokens += best_len
        layers = [(keys[:, :, :best_len], values[:, :, :best_len]) for keys, values in self._entries[best]]
        return Prefix(best_len, layers)

    def store(self, key: Hashable, ids: Sequence[int], layers: list[tuple[Tensor, Tensor]]) -> None:
        """Keep a prompt's keys and values (per layer [1, H, len(ids), D]); evict to stay in bounds."""
        n = len(ids)
        if n < 2 or n > self.max_tokens:
            return
        entry_key = (key, tuple(int(t) for t in ids))
        if entry_key in self._entries:
            self._entries.move_to_end(entry_key)
            return
        for k, stored in list(self._entries):  # a stored prompt this one extends adds nothing
            if k == key and len(stored) < n and entry_key[1][: len(stored)] == stored:
                self.tokens -= len(stored)
                del self._entries[(k, stored)]
        self._entries[entry_key] = [(keys.detach(), values.detach()) for keys, values in layers]
        self.tokens += n
        while self.tokens > self.max_tokens:
            (_, old), _ = self._entries.popitem(last=False)
            self.tokens -= len(old)

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = 0


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the common prefix of two token tuples."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search on the first difference (tuple slices compare in C)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
