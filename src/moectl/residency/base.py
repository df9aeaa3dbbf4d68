"""The cache interface every replacement policy implements (see ``caches.py`` for the semantics)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

from moectl.errors import ConfigError


class Cache:
    """One layer's resident experts under a replacement policy (see the module doc)."""

    name = ""

    def __init__(self, budget: int, num_experts: int) -> None:
        if budget < 1:
            raise ConfigError(f"a cache needs at least one slot, got budget {budget}")
        self.budget, self.num_experts = budget, num_experts

    @property
    def resident(self) -> Collection[int]:
        raise NotImplementedError

    def step(self, need: Sequence[int]) -> int:
        """Serve one token's distinct experts ``need``; returns how many were resident (hits)."""
        raise NotImplementedError


def first_not_in(order: OrderedDict[int, None], protect: Sequence[int]) -> int | None:
    """The oldest entry of ``order`` not in ``protect`` (None if every entry is protected)."""
    return next((e for e in order if e not in protect), None)
