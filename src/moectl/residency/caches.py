"""Online replacement policies for one MoE layer's resident experts, one cache object per layer.

Every cache has ``budget`` slots over ``num_experts`` experts, starts empty and serves one token's
experts at a time with ``step(need) -> hits``: the experts of ``need`` already resident are hits
(their metadata updated first), the others are misses; to make room, the policy evicts resident
experts that ``need`` does not name (never one the current token needs: a token's experts are
resident together), then the misses are inserted in ``need``'s order. ``resident`` is the
resident set after the step. The same objects decide residency when serving
(``offload/residency.py``), so the simulator and the runtime share this code.

- ``lru``: least recently used.
- ``lfu``: least frequently used, counts kept while resident (reset on eviction), ties LRU.
- ``lfuda``: LFU with dynamic aging (Arlitt et al. 2000): key K = count + L, L the key of the
  last victim, so old popular experts age out; ties LRU.
- ``arc``: Adaptive Replacement Cache (Megiddo & Modha, FAST 2003), in ``arc.py``.
- ``s3fifo``: S3-FIFO (Yang et al., SOSP 2023), in ``s3fifo.py``.
- ``least-stale``: SpecMD's Least-Stale (Hoang et al. 2026), as its public reimplementations
  describe it: each expert's reuse interval is an exponential moving average of its observed gaps
  (kept across evictions); the victim is the expert whose predicted next use (last use + interval)
  is farthest. Deviation: the paper's own pseudo-code was not available to us; α = 0.5 and an
  unseen expert's interval E/k (uniform routing's mean gap) are our choices.
- ``static``: a fixed subset per layer pinned, the other slots served LRU (``StaticCache``).

Multi-expert requests (top-k > 1) adapt the single-request algorithms the same way everywhere:
hits first, then each miss in turn with the current token's experts protected (ARC and S3-FIFO
skip a protected expert where they would evict it; one eviction frees one slot).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence

from moectl.residency.arc import ARCCache
from moectl.residency.base import Cache
from moectl.residency.s3fifo import S3FIFOCache

__all__ = ["ONLINE", "ARCCache", "Cache", "LFUCache", "LFUDACache", "LRUCache", "LeastStaleCache",
           "PriorityCache", "S3FIFOCache", "StaticCache"]  # fmt: skip

_TIE = 1 << 40  # priority = key * _TIE + time: ties in key go to the least recently used


class LRUCache(Cache):
    name = "lru"

    def __init__(self, budget: int, num_experts: int) -> None:
        super().__init__(budget, num_experts)
        self.order: OrderedDict[int, None] = OrderedDict()  # least recently used first

    @property
    def resident(self) -> Collection[int]:
        return self.order.keys()

    def step(self, need: Sequence[int]) -> int:
        order = self.order
        hits = 0
        missing = []
        for e in need:
            if e in order:
                hits += 1
                order.move_to_end(e)
            else:
                missing.append(e)
        if missing:
            # the token's hits were just moved to the end: the front holds no needed expert
            for _ in range(len(order) + len(missing) - self.budget):
                order.popitem(last=False)
            for e in missing:
                order[e] = None
        return hits


class PriorityCache(Cache):
    """Evicts the resident experts of smallest priority (a lazy min-heap: stale entries skipped).

    Subclasses give the priority of an expert at a hit (``hit``) and at its insertion
    (``insert``), and may note a victim (``evicted``)."""

    def __init__(self, budget: int, num_experts: int) -> None:
        super().__init__(budget, num_experts)
        self.prio: dict[int, int | float] = {}  # resident expert -> its current priority
        self.heap: list[tuple[int | float, int]] = []
        self.t = 0  # tokens served

    @property
    def resident(self) -> Collection[int]:
        return self.prio.keys()

    def hit(self, e: int, k: int) -> int | float:
        raise NotImplementedError

    def insert(self, e: int, k: int) -> int | float:
        raise NotImplementedError

    def evicted(self, e: int, priority: int | float) -> None:
        pass

    def step(self, need: Sequence[int]) -> int:
        self.t += 1
        prio, heap, k = self.prio, self.heap, len(need)
        hits = 0
        missing = []
        for e in need:
            if e in prio:
                hits += 1
                p = prio[e] = self.hit(e, k)
                heapq.heappush(heap, (p, e))
            else:
                missing.append(e)
        if not missing:
            return hits
        over = len(prio) + len(missing) - self.budget
        kept = []
        while over > 0:
            p, e = heapq.heappop(heap)
            if prio.get(e) != p:
                continue  # a stale entry: the expert was accessed again or evicted since
            if e in need:
                kept.append((p, e))
                continue
            del prio[e]
            self.evicted(e, p)
            over -= 1
        for item in kept:
            heapq.heappush(heap, item)
        for e in missing:
            p = prio[e] = self.insert(e, k)
            heapq.heappush(heap, (p, e))
        if len(heap) > 4 * self.budget + 64:  # drop stale entries
            self.heap = [(p, e) for e, p in prio.items()]
            heapq.heapify(self.heap)
        return hits


class LFUCache(PriorityCache):
    name = "lfu"

    def __init__(self, budget: int, num_experts: int) -> None:
        super().__init__(budget, num_experts)
        self.count: dict[int, int] = {}

    def hit(self, e: int, k: int) -> int:
        c = self.count[e] = self.count[e] + 1
        return c * _TIE + self.t

    def insert(self, e: int, k: int) -> int:
        self.count[e] = 1
        return _TIE + self.t

    def evicted(self, e: int, priority: int | float) -> None:
        del self.count[e]


class LFUDACache(LFUCache):
    name = "lfuda"

    def __init__(self, budget: int, num_experts: int) -> None:
        super().__init__(budget, num_experts)
        self.age = 0  # L: the key of the last victim

    def hit(self, e: int, k: int) -> int:
        c = self.count[e] = self.count[e] + 1
        return (c + self.age) * _TIE + self.t

    def insert(self, e: int, k: int) -> int:
        self.count[e] = 1
        return (1 + self.age) * _TIE + self.t

    def evicted(self, e: int, priority: int | float) -> None:
        del self.count[e]
        self.age = int(priority) // _TIE


class LeastStaleCache(PriorityCache):
    name = "least-stale"
    alpha = 0.5

    def __init__(self, budget: int, num_experts: int) -> None:
        super().__init__(budget, num_experts)
        self.last: dict[int, int] = {}  # kept across evictions: the observed history
        self.interval: dict[int, float] = {}

    def _use(self, e: int, k: int) -> float:
        t = self.t
        previous = self.last.get(e)
        if previous is not None:
            gap = t - previous
            old = self.interval.get(e)
            self.interval[e] = gap if old is None else self.alpha * gap + (1 - self.alpha) * old
        self.last[e] = t
        interval = self.interval.get(e, self.num_experts / k)
        return -(t + interval)  # the farthest predicted next use is evicted first

    hit = insert = _use


class StaticCache(LRUCache):
    """``pinned`` stays resident from its first use on; the other ``budget - len(pinned)`` slots
    (at least top-k, checked by the caller) serve the remaining experts LRU."""

    name = "static"

    def __init__(self, budget: int, num_experts: int, pinned: Collection[int] = ()) -> None:
        super().__init__(budget - len(pinned), num_experts)
        self.pinned = frozenset(pinned)
        self.loaded: set[int] = set()
        self.full_budget = budget

    @property
    def resident(self) -> Collection[int]:
        return self.loaded | self.order.keys()

    def step(self, need: Sequence[int]) -> int:
        pinned, loaded = self.pinned, self.loaded
        hits = 0
        rest = []
        for e in need:
            if e in pinned:
                if e in loaded:
                    hits += 1
                else:
                    loaded.add(e)
            else:
                rest.append(e)
        return hits + (super().step(rest) if rest else 0)


ONLINE: dict[str, Callable[[int, int], Cache]] = {
    "lru": LRUCache,
    "lfu": LFUCache,
    "lfuda": LFUDACache,
    "arc": ARCCache,
    "s3fifo": S3FIFOCache,
    "least-stale": LeastStaleCache,
}
"""The online policies by name (``static`` and ``belady`` need more than a budget: see simulate.py)."""
