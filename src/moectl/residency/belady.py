"""The offline optimum: Belady's MIN with multi-expert requests.

At a miss with the cache full, evict the resident experts whose next use is farthest in the
future (never: first), never one the current token needs. With every expert the same size and
every request served from the cache, this is the fewest misses any policy can have on the trace
(Belady 1966; a token's k experts are k requests that may not evict one another — checked
against exhaustive search in tests/test_residency_belady.py).

The next use of every access is computed once, vectorised (``next_use``); the replay is the
priority cache of ``caches.py`` with priority −(next use).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moectl.residency.caches import PriorityCache


def next_use(chosen: np.ndarray, num_experts: int) -> np.ndarray:
    """[T, k] the token index at which ``chosen[t, j]``'s expert is next used (T when never again).

    ``chosen`` [T, k] holds one layer's distinct expert ids per token. Vectorised: the accesses
    sorted by (expert, token) are consecutive uses of one expert."""
    tokens, k = chosen.shape
    flat = chosen.reshape(-1).astype(np.int64)
    time = np.repeat(np.arange(tokens, dtype=np.int64), k)
    order = np.lexsort((time, flat))
    nxt_sorted = np.full(flat.shape[0], tokens, dtype=np.int64)
    same = flat[order[1:]] == flat[order[:-1]]
    nxt_sorted[:-1][same] = time[order[1:]][same]
    out = np.empty_like(nxt_sorted)
    out[order] = nxt_sorted
    return out.reshape(tokens, k)


class BeladyCache(PriorityCache):
    """Belady's MIN for one layer's sequence ``chosen`` [T, k], replayed token by token with ``step``."""

    name = "belady"

    def __init__(self, budget: int, num_experts: int, chosen: np.ndarray) -> None:
        super().__init__(budget, num_experts)
        self.chosen = chosen
        self.next = next_use(chosen, num_experts).tolist()
        self._slot: dict[int, int] = {}

    def step(self, need: Sequence[int]) -> int:
        row = self.next[self.t]  # the token being served (self.t counts tokens served so far)
        self._slot = dict(zip(need, row, strict=True))
        return super().step(need)

    def hit(self, e: int, k: int) -> int:
        return -self._slot[e]

    insert = hit
