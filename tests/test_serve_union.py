"""A forward's experts are not evicted before it uses them: ``ResidentSet``'s victims under a batch
whose rows need more distinct experts together (their union) than the budget holds."""

from __future__ import annotations

import torch

import moectl
from moectl.engine import Engine, EngineConfig, SamplingParams
from moectl.offload.expert_store import HostStore
from moectl.offload.offload_config import OffloadConfig
from moectl.offload.resident import ResidentSet


def _resident(budget: int, num_experts: int = 6) -> tuple[ResidentSet, dict]:
    weights = {"w": torch.arange(num_experts * 3, dtype=torch.float32).reshape(num_experts, 3)}
    return ResidentSet(0, HostStore([weights]), budget, {"w": weights["w"].to("meta")}, "cpu"), weights


def _step(res: ResidentSet, step: int, experts: list[int]) -> None:
    """One forward as the experts loops run it: expect the set, then access in ascending order."""
    res.begin_step(step)
    res.expect(experts)
    for e in sorted(experts):
        res.access(e)


def test_a_needed_resident_expert_is_not_evicted_before_its_use():
    """Resident [1 (least recent), 2]; the token needs {0, 1}: loading 0 evicts 2 (not needed), so 1
    is a hit. Plain LRU evicted 1, then reloaded it over 2: two loads, no hit."""
    res, weights = _resident(2)
    _step(res, 1, [1, 2])
    loads = res.loads
    _step(res, 2, [0, 1])
    assert res.loads - loads == 1 and sorted(res.where) == [0, 1]
    assert res.hits == 1
    for e, slot in res.where.items():
        assert torch.equal(res.slots["w"][slot], weights["w"][e])


def test_a_union_above_the_budget_reloads_only_what_does_not_fit():
    """A step needing {0, 1, 2, 3} with budget 3 and {1, 2, 3} resident: one unavoidable eviction goes
    to the expert visited last (3), the others are hits: 2 loads (LRU over the ascending visit: 4)."""
    res, weights = _resident(3)
    _step(res, 1, [1, 2, 3])
    loads, hits = res.loads, res.hits
    _step(res, 2, [0, 1, 2, 3])
    assert res.loads - loads == 2 and res.hits - hits == 2
    _step(res, 3, [0, 1, 2, 3])  # the same union again: still only what does not fit is reloaded
    assert res.loads - loads <= 4
    for e, slot in res.where.items():
        assert torch.equal(res.slots["w"][slot], weights["w"][e])


def test_engine_reports_the_union_of_its_rows_and_stays_exact():
    """Four rows under a budget of 4 of 8 experts: the decode steps' union per layer is reported
    (above the budget here), and the tokens still equal the resident model's."""
    model, tok, _ = moectl.load("tiny:olmoe", dtype="float32")
    prompts = ["The history of", "def f(x):", "a b c", "Photosynthesis"]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    plain = [c.token_ids for c in Engine(model, tok, EngineConfig(max_batch=4)).generate(prompts, params)]
    offload = OffloadConfig(budget=4, store="host")
    engine = Engine(model, tok, EngineConfig(max_batch=4, offload=offload))
    with engine:
        got = [c.token_ids for c in engine.generate(prompts, params)]
        stats = engine.stats()["offload"]
        events = engine.runtime.events()
    assert got == plain
    assert len(set(events)) == len(events)  # no expert loaded twice in one forward of one layer
    assert stats["budget_per_layer"] == 4
    assert 2 <= stats["union_mean"] <= stats["union_max"] <= 8
    assert stats["union_max"] > 4  # this batch needs more than the budget at some layer
