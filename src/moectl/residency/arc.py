"""ARC, the Adaptive Replacement Cache (Megiddo & Modha, FAST 2003), with multi-expert requests.

A recency list T1 (seen once recently), a frequency list T2 (seen at least twice), and ghost lists
B1/B2 of their victims' ids; a ghost hit moves the target size p of T1 towards the list whose
victim was needed again. A token's experts are served hits first, then each miss in turn; REPLACE
never evicts one of the token's experts (it takes the other list's LRU when its list holds only
those), and ghosts are trimmed to ARC's directory of 2c entries.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

from moectl.residency.base import Cache, first_not_in


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
                del t1[first_not_in(t1, protect)]
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
            victim = first_not_in(source, protect)
            if victim is not None:
                del source[victim]
                ghost[victim] = None
                return
