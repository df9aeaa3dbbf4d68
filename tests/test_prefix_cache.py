"""The prompt-prefix store (engine/prefix_cache.py): longest prefix, keys kept apart, bounds, LRU."""

from __future__ import annotations

import pytest
import torch

from moectl.engine.prefix_cache import PrefixCache, _common
from moectl.errors import ConfigError


def kv(ids: list[int], layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer keys/values [1, 1, n, 1] whose value at position t is the token there (traceable)."""
    t = torch.tensor(ids, dtype=torch.float32).view(1, 1, -1, 1)
    return [(t + layer, -t - layer) for layer in range(layers)]


def test_the_longest_stored_prefix_is_returned_but_never_the_last_token():
    cache = PrefixCache(100)
    cache.store("r", [1, 2, 3, 4], kv([1, 2, 3, 4]))
    cache.store("r", [1, 2, 9, 9, 9], kv([1, 2, 9, 9, 9]))
    hit = cache.lookup("r", [1, 2, 3, 4, 5, 6])
    assert hit is not None and hit.length == 4
    assert hit.layers[1][0].flatten().tolist() == [2.0, 3.0, 4.0, 5.0]  # layer 1's keys = token + 1
    same = cache.lookup("r", [1, 2, 3, 4])  # the whole stored prompt again: its last token is recomputed
    assert same is not None and same.length == 3
    assert cache.lookup("r", [7, 1, 2]) is None


def test_prefixes_of_another_routing_are_never_reused():
    cache = PrefixCache(100)
    cache.store("mask", [1, 2, 3], kv([1, 2, 3]))
    assert cache.lookup(None, [1, 2, 3, 4]) is None
    assert cache.lookup("mask", [1, 2, 3, 4]).length == 3


def test_the_store_stays_within_its_tokens_least_recently_used_first():
    cache = PrefixCache(10)
    cache.store("r", [1, 1, 1, 1], kv([1, 1, 1, 1]))
    cache.store("r", [2, 2, 2, 2], kv([2, 2, 2, 2]))
    assert cache.lookup("r", [1, 1, 5]).length == 2  # touches [1, 1, 1, 1]: [2, ...] is now the oldest
    cache.store("r", [3, 3, 3, 3], kv([3, 3, 3, 3]))
    assert cache.tokens == 8 and len(cache) == 2
    assert cache.lookup("r", [2, 2, 5]) is None
    cache.store("r", list(range(11)), kv(list(range(11))))  # longer than the whole store: not kept
    assert cache.tokens == 8


def test_a_prompt_that_extends_a_stored_one_replaces_it():
    cache = PrefixCache(100)
    cache.store("r", [1, 2, 3], kv([1, 2, 3]))
    cache.store("r", [1, 2, 3, 4, 5], kv([1, 2, 3, 4, 5]))
    assert len(cache) == 1 and cache.tokens == 5


def test_a_size_that_is_not_a_token_count_is_refused():
    with pytest.raises(ConfigError, match="integer >= 0"):
        PrefixCache(-1)


@pytest.mark.parametrize(("a", "b", "n"), [((), (1,), 0), ((1, 2, 3), (1, 2, 4), 2), ((5,), (6,), 0),
                                           ((1, 2), (1, 2, 3), 2), (tuple(range(100)), (*range(57), 0), 57)])  # fmt: skip
def test_common_prefix_length(a, b, n):
    assert _common(a, b) == n == _common(b, a)


# -- the engine with a prefix cache: the same tokens as without, fewer prompt tokens run ----------

import functools  # noqa: E402

import moectl  # noqa: E402
from moectl.engine import Engine, EngineConfig, SamplingParams  # noqa: E402

MASK = {"type": "expert_mask", "experts": {"0": [0, 1, 2, 3], "2": [4, 5, 6, 7]}}
BASE = "The history of the city of Rome begins with a small settlement on the river"
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True, seed=3)


@functools.cache
def _loaded():
    return moectl.load("tiny:olmoe", dtype="float32")


def _engine(prefix_tokens: int, **kw) -> Engine:
    model, tok, _ = _loaded()
    return Engine(model, tok, EngineConfig(prefix_cache_tokens=prefix_tokens, **kw),
                  routings={"mask": MASK, "gumbel": {"type": "gumbel", "tau": 1.0, "seed": 5}})  # fmt: skip


@pytest.mark.parametrize("routing", [None, "mask"])
def test_a_prompt_extending_an_earlier_one_runs_only_its_new_tokens_and_decodes_the_same(routing):
    prompts = [BASE, BASE + " and the hills", BASE, "Something else entirely"]
    plain = [c.token_ids for c in _engine(0).generate(prompts, PARAMS, routing=routing)]
    cached = _engine(4096, max_batch=1)
    got = [c.token_ids for c in cached.generate(prompts, PARAMS, routing=routing)]
    assert got == plain
    n = len(moectl.engine.engine.encode(_loaded()[1], BASE))
    # the second prompt reuses BASE's n tokens, the third reuses n − 1 (its last token is run again)
    assert cached.stats()["prefix_tokens_reused"] == n + (n - 1)


def test_prefixes_are_kept_per_routing_and_never_for_per_request_state():
    engine = _engine(4096, max_batch=1)
    engine.generate([BASE], PARAMS)
    engine.generate([BASE + " again"], PARAMS, routing="mask")  # another routing: not reused
    assert engine.stats()["prefix_tokens_reused"] == 0
    engine.generate([BASE, BASE], PARAMS, routing="gumbel")  # per-request noise: never stored or reused
    stored = [len(moectl.engine.engine.encode(_loaded()[1], p)) for p in (BASE, BASE + " again")]
    assert engine.stats()["prefix_tokens_reused"] == 0 and engine.prefixes.tokens == sum(stored)


def test_a_cached_prompt_joins_a_running_batch_and_each_row_decodes_as_alone():
    long = SamplingParams(max_tokens=20, ignore_eos=True)
    solo = {
        p: _engine(0).generate([p], long)[0].token_ids for p in (BASE, BASE + " and the sea", "def f(x):")
    }
    engine = _engine(4096, max_batch=4)
    engine.generate([BASE], long)  # stored
    engine.open()
    try:
        first = engine._submit("def f(x):", long, None, None)
        engine.step()  # "def f(x):" is running when the cached prompt arrives
        second = engine._submit(BASE + " and the sea", long, None, None)
        while not (first.done.is_set() and second.done.is_set()):
            engine.step()
    finally:
        engine.close()
    assert first.completion.token_ids == solo["def f(x):"]
    assert second.completion.token_ids == solo[BASE + " and the sea"]
    assert engine.stats()["prefix_tokens_reused"] > 0


@pytest.mark.parametrize("routing", [None, "mask"])
def test_prompts_with_stored_prefixes_of_different_lengths_prefill_together_as_alone(routing):
    other = "def fibonacci(n): return n if n < 2 else"
    later = [BASE + " x", other + " fibonacci(n - 1) + fibonacci(n - 2)", BASE]
    plain = [c.token_ids for c in _engine(0).generate(later, PARAMS, routing=routing)]
    engine = _engine(4096, max_batch=4, log_forwards=True)
    engine.generate([BASE, other], PARAMS, routing=routing)
    engine.forward_log.clear()
    got = [c.token_ids for c in engine.generate(later, PARAMS, routing=routing)]
    assert got == plain
    assert engine.forward_log[0] == ("prefill", 3)  # the three hits in one forward
    assert [kind for kind, _ in engine.forward_log].count("prefill") == 1


def test_a_model_with_sliding_window_layers_keeps_no_prefix():
    model, tok, _ = moectl.load("tiny:gpt_oss", dtype="float32")
    engine = Engine(model, tok, EngineConfig(prefix_cache_tokens=4096))
    plain = Engine(model, tok).generate([BASE, BASE], PARAMS)
    assert [c.token_ids for c in engine.generate([BASE, BASE], PARAMS)] == [c.token_ids for c in plain]
    assert engine.stats()["prefix_tokens_reused"] == 0 and engine.prefixes.tokens == 0


def test_a_prompt_prefilled_in_chunks_is_stored_and_a_later_one_reuses_it():
    long = BASE + " " + " ".join(f"w{i}" for i in range(60))  # ~ 370 byte tokens: 6 chunks of 64
    prompts = [long, long + " and more", "short one"]
    plain = [c.token_ids for c in _engine(0).generate(prompts, PARAMS)]
    engine = _engine(4096, max_batch=1, prefill_chunk=64, log_forwards=True)  # one by one: stored first
    got = [c.token_ids for c in engine.generate(prompts, PARAMS)]
    assert got == plain
    assert ("chunk", 1) in engine.forward_log
    assert engine.stats()["prefix_tokens_reused"] == len(moectl.engine.engine.encode(_loaded()[1], long))


@pytest.mark.parametrize("routing", [None, "mask"])
def test_the_same_prompt_admitted_together_is_prefilled_once(routing):
    """n choices of one prompt (or clients sending the same one at once): the first is prefilled, its
    twins wait one step and prefill only their last token from its stored KV; each draws as alone."""
    sampled = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.9, seed=3)
    plain = [c.token_ids for c in _engine(0).generate([BASE] * 4, sampled, routing=routing, seed_per_prompt=True)]
    engine = _engine(4096, max_batch=8, log_forwards=True)
    got = [c.token_ids for c in engine.generate([BASE] * 4, sampled, routing=routing, seed_per_prompt=True)]
    assert got == plain and len({tuple(g) for g in got}) > 1
    n = len(moectl.engine.engine.encode(_loaded()[1], BASE))
    assert engine.stats()["prefix_tokens_reused"] == 3 * (n - 1)
    assert [entry for entry in engine.forward_log if entry[0] == "prefill"] == [("prefill", 1), ("prefill", 3)]


def test_a_twin_of_a_prompt_prefilled_in_chunks_waits_for_its_chunks():
    long = BASE + " " + " ".join(f"w{i}" for i in range(60))
    plain = [c.token_ids for c in _engine(0).generate([long, long, "short one"], PARAMS)]
    engine = _engine(4096, max_batch=4, prefill_chunk=64, log_forwards=True)
    got = [c.token_ids for c in engine.generate([long, long, "short one"], PARAMS)]
    assert got == plain
    n = len(moectl.engine.engine.encode(_loaded()[1], long))
    assert engine.forward_log.count(("chunk", 1)) == -(-n // 64)  # one prompt's chunks, not two
    assert engine.stats()["prefix_tokens_reused"] == n - 1


def test_without_a_prefix_cache_twins_prefill_together():
    engine = _engine(0, max_batch=8, log_forwards=True)
    engine.generate([BASE] * 3, PARAMS)
    assert engine.forward_log[0] == ("prefill", 3)
