"""S3-FIFO (Yang et al., SOSP 2023), with multi-expert requests.

A small FIFO of 10% of the slots (at least one) takes new experts; one leaving it goes to the main
FIFO if used again while there (frequency > 1), else its id to a ghost FIFO of the main's size; an
expert whose id is a ghost enters main directly. Main reinserts its oldest expert while its 2-bit
frequency is above 0 (decrementing it). One eviction frees one slot; the current token's experts
are never evicted (a protected expert leaving small goes to main).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

from moectl.residency.base import Cache, first_not_in


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
            x = first_not_in(self.s, protect)
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
