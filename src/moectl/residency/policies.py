"""Online replacement policies for one MoE layer's resident experts, one cache object per layer.

Every cache has ``budget`` slots over ``num_experts`` experts, starts empty and serves one token's
experts at a time with ``step(need) -> hits``: the experts of ``need`` already resident are hits
(their metadata updated first), the others are misses; to make room, the policy evicts resident
experts that ``need`` does not name (never one the current token needs: a token's experts are
resident together), then the misses are inserted in ``need``'s order. ``resident`` is the
resident set after the step. The same objects decide residency when serving
(``serve/policies.py``), so the simulator and the runtime share this code.

- ``lru``: least recently used.
- ``lfu``: least frequently used, counts kept while resident (reset on eviction), ties LRU.
- ``lfuda``: LFU with dynamic aging (Arlitt et al. 2000): key K = count + L, L the key of the
  last victim, so old popular experts age out; ties LRU.
- ``arc``: Adaptive Replacement Cache (Megiddo & Modha, FAST 2003): recency list T1, frequency
  list T2, ghosts B1/B2 steering the target size p of T1.
- ``s3fifo``: S3-FIFO (Yang et al., SOSP 2023): a small FIFO of 10% of the slots, a main FIFO
  with 2-bit frequencies (reinsertion while frequency > 0), a ghost FIFO of the main's size.
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

_TIE = 1 << 40  # priority = key * _TIE + time: ties in key go to the least recently used


class Cache:
    """One layer's resident experts under a replacement policy (see the module doc)."""

    name = ""

    def __init__(self, budget: int, num_experts: int) -> None:
        if budget < 1:
            raise ValueError(f"a cache needs at least one slot, got budget {budget}")
        self.budget, self.num_experts = budget, num_experts

    @property
    def resident(self) -> Collection[int]:
        raise NotImplementedError

    def step(self, need: Sequence[int]) -> int:
        """Serve one token's distinct experts ``need``; returns how many were resident (hits)."""
        raise NotImplementedError


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


class ARCCache(Cache):
    name = "arc"

    def __init__(self, budget: int, num_experts: int) -> None:
        super().__init__(budget, num_experts)
        self.p = 0.0  # target size of T1
        self.t1: OrderedDict[int, None] = OrderedDict()  # seen once recently (LRU first)
        self.t2: OrderedDict[int, None] = OrderedDict()  # seen at least twice recently
        self.b1: OrderedDict[int, None] = OrderedDict()  # ghosts of T1's victims
        self.b2: OrderedDict[int, None] = OrderedDict()  # ghosts of T2's victims

    @property
    def resident(self) -> Collection[int]:
        return self.t1.keys() | self.t2.keys()

    def step(self, need: Sequence[int]) -> int:
        t1, t2 = self.t1, self.t2
        hits = 0
        missing = []
        for x in need:
            if x in t1:
                del t1[x]
                t2[x] = None
                hits += 1
            elif x in t2:
                t2.move_to_end(x)
                hits += 1
            else:
                missing.append(x)
        for x in missing:
            self._miss(x, need)
        return hits

    def _miss(self, x: int, protect: Sequence[int]) -> None:
        c, t1, t2, b1, b2 = self.budget, self.t1, self.t2, self.b1, self.b2
        if x in b1:
            self.p = min(float(c), self.p + max(len(b2) / len(b1), 1.0))
            del b1[x]
            self._replace(False, protect)
            t2[x] = None
            return
        if x in b2:
            self.p = max(0.0, self.p - max(len(b1) / len(b2), 1.0))
            del b2[x]
            self._replace(True, protect)
            t2[x] = None
            return
        if len(t1) + len(b1) >= c:
            if len(t1) < c:
                b1.popitem(last=False)
                self._replace(False, protect)
            else:  # T1 fills the cache: its LRU leaves without a ghost
                del t1[_first_not_in(t1, protect)]
        elif len(t1) + len(b1) + len(t2) + len(b2) >= c:
            while len(t1) + len(b1) + len(t2) + len(b2) >= 2 * c and b2:
                b2.popitem(last=False)
            self._replace(False, protect)
        t1[x] = None

    def _replace(self, x_in_b2: bool, protect: Sequence[int]) -> None:
        """ARC's REPLACE, when the cache is full: T1's LRU to B1 or T2's LRU to B2 (unprotected)."""
        t1, t2 = self.t1, self.t2
        if len(t1) + len(t2) < self.budget:
            return
        if t1 and ((x_in_b2 and len(t1) == self.p) or len(t1) > self.p):
            order = ((t1, self.b1), (t2, self.b2))
        else:
            order = ((t2, self.b2), (t1, self.b1))
        for source, ghost in order:
            victim = _first_not_in(source, protect)
            if victim is not None:
                del source[victim]
                ghost[victim] = None
                return


class S3FIFOCache(Cache):
    name = "s3fifo"

    def __init__(self, budget: int, num_experts: int) -> None:
        super().__init__(budget, num_experts)
        self.small_cap = max(1, round(0.1 * budget))
        self.main_cap = budget - self.small_cap
        self.s: OrderedDict[int, None] = OrderedDict()  # FIFO, oldest first
        self.m: OrderedDict[int, None] = OrderedDict()
        self.g: OrderedDict[int, None] = OrderedDict()  # ghost ids, oldest first
        self.freq: dict[int, int] = {}

    @property
    def resident(self) -> Collection[int]:
        return self.s.keys() | self.m.keys()

    def step(self, need: Sequence[int]) -> int:
        freq = self.freq
        hits = 0
        missing = []
        for x in need:
            f = freq.get(x)
            if f is None:
                missing.append(x)
            else:
                hits += 1
                if f < 3:
                    freq[x] = f + 1
        for x in missing:
            ghost = x in self.g  # a ghost hit is decided at the request, before evictions move the ghosts
            while len(self.s) + len(self.m) >= self.budget:
                self._evict(need)
            if ghost:
                self.g.pop(x, None)
                self.m[x] = None
            else:
                self.s[x] = None
            freq[x] = 0
        return hits

    def _evict(self, protect: Sequence[int]) -> None:
        if (len(self.s) >= self.small_cap or not self.m) and self._evict_s(protect):
            return
        self._evict_m(protect)

    def _evict_s(self, protect: Sequence[int]) -> bool:
        s, freq = self.s, self.freq
        while s:
            x, _ = s.popitem(last=False)
            if freq[x] > 1 or x in protect:  # accessed again (or needed now): promoted to main
                self.m[x] = None
                if len(self.m) > self.main_cap:
                    self._evict_m(protect)
                    return True
            else:
                self.g[x] = None
                while len(self.g) > self.main_cap:
                    self.g.popitem(last=False)
                del freq[x]
                return True
        return False

    def _evict_m(self, protect: Sequence[int]) -> None:
        m, freq = self.m, self.freq
        if all(x in protect for x in m):  # nothing evictable in main: the oldest unprotected of small
            x = _first_not_in(self.s, protect)
            del self.s[x], freq[x]
            self.g[x] = None
            while len(self.g) > self.main_cap:
                self.g.popitem(last=False)
            return
        while True:
            x = next(iter(m))
            if x in protect:
                m.move_to_end(x)
            elif freq[x] > 0:
                freq[x] -= 1
                m.move_to_end(x)
            else:
                del m[x], freq[x]
                return


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


def _first_not_in(order: OrderedDict[int, None], protect: Sequence[int]) -> int | None:
    return next((e for e in order if e not in protect), None)


ONLINE: dict[str, Callable[[int, int], Cache]] = {
    "lru": LRUCache,
    "lfu": LFUCache,
    "lfuda": LFUDACache,
    "arc": ARCCache,
    "s3fifo": S3FIFOCache,
    "least-stale": LeastStaleCache,
}
"""The online policies by name (``static`` and ``belady`` need more than a budget: see simulate.py)."""
