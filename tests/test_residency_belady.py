"""Belady's MIN with multi-expert requests is the optimum: exhaustive search on tiny traces."""

from __future__ import annotations

from itertools import combinations

import numpy as np
import pytest

from moectl.residency.belady import BeladyCache, next_use
from moectl.residency.caches import ONLINE


def fewest_misses(chosen: np.ndarray, budget: int) -> int:
    """Exhaustive search over every resident set after every token (voluntary evictions allowed)."""
    states = {frozenset(): 0}
    for row in chosen.tolist():
        need = frozenset(row)
        nxt: dict[frozenset, int] = {}
        for resident, misses in states.items():
            cost = misses + len(need - resident)
            others = sorted(resident - need)
            for size in range(0, min(len(others), budget - len(need)) + 1):
                for keep in combinations(others, size):
                    state = need | frozenset(keep)
                    if cost < nxt.get(state, 1 << 30):
                        nxt[state] = cost
        states = nxt
    return min(states.values())


def belady_misses(chosen: np.ndarray, budget: int, num_experts: int) -> int:
    cache = BeladyCache(budget, num_experts, chosen)
    return chosen.size - sum(cache.step(row) for row in chosen.tolist())


def test_next_use():
    chosen = np.array([[0, 1], [2, 0], [1, 3], [0, 2]])
    assert next_use(chosen, 4).tolist() == [[1, 2], [3, 3], [4, 4], [4, 4]]


@pytest.mark.parametrize("k", [1, 2])
def test_belady_matches_exhaustive_search(k):
    rng = np.random.default_rng(k)
    num_experts = 5
    for trial in range(40):
        tokens = int(rng.integers(4, 9))
        chosen = np.stack([rng.choice(num_experts, k, replace=False) for _ in range(tokens)])
        for budget in range(k, 4):
            best = fewest_misses(chosen, budget)
            assert belady_misses(chosen, budget, num_experts) == best, (trial, budget, chosen.tolist())
            for name, cls in ONLINE.items():  # no online policy beats the optimum
                cache = cls(budget, num_experts)
                misses = chosen.size - sum(cache.step(row) for row in chosen.tolist())
                assert misses >= best, name
