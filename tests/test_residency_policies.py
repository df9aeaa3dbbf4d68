"""Replacement policies on sequences small enough to follow by hand (moectl.residency.caches)."""

from __future__ import annotations

import numpy as np
import pytest

from moectl.residency.belady import BeladyCache
from moectl.residency.caches import (
    ONLINE,
    ARCCache,
    LeastStaleCache,
    LFUCache,
    LFUDACache,
    LRUCache,
    S3FIFOCache,
    StaticCache,
)


def serve(cache, tokens) -> int:
    return sum(cache.step(list(t) if isinstance(t, tuple) else [t]) for t in tokens)


def test_lru_single_expert():
    # 0 m, 1 m, 0 h, 2 m (evicts 1), 0 h, 1 m (evicts 2)
    cache = LRUCache(2, 4)
    assert serve(cache, [0, 1, 0, 2, 0, 1]) == 2
    assert sorted(cache.resident) == [0, 1]


def test_lru_never_evicts_what_the_token_needs():
    # (0,1) m m | (2,0): 0 h, 2 m | (3,1): 1 h, 3 m evicts 0 | (0,2): 2 h, 0 m evicts 1
    cache = LRUCache(3, 8)
    assert serve(cache, [(0, 1), (2, 0), (3, 1), (0, 2)]) == 3
    assert sorted(cache.resident) == [0, 2, 3]
    # 5 is the least recently used but the token needs it: 6 goes instead
    cache = LRUCache(2, 8)
    assert serve(cache, [5, 6, (7, 5)]) == 1
    assert sorted(cache.resident) == [5, 7]


def test_lfu_keeps_the_frequent_expert():
    # 0 m, 0 h, 1 m, 2 m (evicts 1: count 1 < 2), 1 m (evicts 2), 2 m (evicts 1)
    cache = LFUCache(2, 4)
    assert serve(cache, [0, 0, 1, 2, 1, 2]) == 1
    assert sorted(cache.resident) == [0, 2]


def test_lfuda_ages_out_an_old_favourite():
    # LFU pins 0 (count 3) and thrashes 1/2 forever: 2 hits. LFUDA: L rises with each victim's key
    # (1, then 2), the newcomer's key 1 + L = 3 ties 0's and 0, older, goes at the 7th token.
    tokens = [0, 0, 0, 1, 2, 1, 2, 1, 2]
    assert serve(LFUCache(2, 4), tokens) == 2
    cache = LFUDACache(2, 4)
    assert serve(cache, tokens) == 4
    assert sorted(cache.resident) == [1, 2] and cache.age == 3


def test_arc_follows_the_paper():
    # c = 2: 0 m (T1), 1 m (T1), 0 h (to T2), 2 m (REPLACE: |T1| = 1 > p = 0, 1 to B1),
    # 0 h, 1 m in B1 (p = 1; REPLACE: |T1| = 1 is not > p, T2's 0 to B2; 1 to T2)
    cache = ARCCache(2, 4)
    assert serve(cache, [0, 1, 0, 2, 0, 1]) == 2
    assert (list(cache.t1), list(cache.t2), list(cache.b1), list(cache.b2)) == ([2], [1], [], [0])
    assert cache.p == 1.0


def test_s3fifo_promotes_reused_and_drops_one_hit_wonders():
    # budget 2: small FIFO 1, main 1. 0 m, 0 h, 0 h (freq 2), 1 m, 2 m: small's tail 0 (freq 2) to
    # main, then 1 (freq 0) to the ghost; 3 m: 2 to the ghost (which keeps 1 id); 0 h from main.
    cache = S3FIFOCache(2, 8)
    assert serve(cache, [0, 0, 0, 1, 2, 3, 0]) == 3
    assert (list(cache.s), list(cache.m), list(cache.g)) == ([3], [0], [2])
    # 2 is a ghost: it comes back into main, not small
    assert serve(cache, [2]) == 0
    assert list(cache.m) == [0, 2] and list(cache.s) == []


def test_least_stale_evicts_the_farthest_predicted_reuse():
    # 0 is used at every token (interval 1); 1, new, gets the default interval E/k = 4:
    # predicted next uses 4 + 1 = 5 for 0 and 5 + 4 = 9 for 1, so 1 goes although LRU would drop 0
    tokens = [0, 0, 0, 0, 1, 2]
    cache = LeastStaleCache(2, 4)
    assert serve(cache, tokens) == 3
    assert sorted(cache.resident) == [0, 2]
    lru = LRUCache(2, 4)
    assert serve(lru, tokens) == 3 and sorted(lru.resident) == [1, 2]


def test_static_pins_its_subset_and_serves_the_rest_lru():
    # pinned {0}; one LRU slot: 0 m (first load), 1 m, 2 m (evicts 1), 0 h, 1 m
    cache = StaticCache(2, 4, pinned=[0])
    assert serve(cache, [0, 1, 2, 0, 1]) == 1
    assert sorted(cache.resident) == [0, 1]


def test_belady_by_hand():
    # 0 m, 1 m, 2 m: 0 is next used at t = 3, 1 at t = 4: 1 goes; 0 h, 1 m
    chosen = np.array([[0], [1], [2], [0], [1]])
    cache = BeladyCache(2, 4, chosen)
    assert serve(cache, chosen[:, 0].tolist()) == 1


@pytest.mark.parametrize("name", sorted(ONLINE))
def test_budget_is_never_exceeded_and_the_token_is_resident(name):
    rng = np.random.default_rng(0)
    for budget, k in ((2, 2), (3, 2), (5, 3), (8, 1)):
        cache = ONLINE[name](budget, 12)
        for _ in range(300):
            need = rng.choice(12, k, replace=False).tolist()
            before = set(cache.resident)
            hits = cache.step(need)
            assert hits == len(before & set(need))
            assert set(need) <= set(cache.resident)
            assert len(cache.resident) <= budget
