"""Serving with ``s3fifo`` / ``arc`` residency counts the hits and misses the simulator counts on the
trace recorded while serving (one implementation: moectl.residency.caches)."""

from __future__ import annotations

import pytest
import torch
from tests._serve_helpers import greedy

import moectl
from moectl.offload.residency import ARCResidency, S3FIFOResidency, parse_policy
from moectl.offload.runtime import offload
from moectl.residency.simulate import SimConfig, run
from moectl.residency.trace_input import read_accesses


@pytest.mark.parametrize("policy", ["s3fifo", "arc"])
def test_runtime_hits_equal_the_simulator(tmp_path, policy):
    model = moectl.tiny("olmoe")  # 8 experts, top-2, 3 MoE layers
    budget = 4
    ids = torch.tensor([[17]])  # one prompt token: every forward serves one token
    with offload(model, budget, policy, store="host") as rt, moectl.route(model, record=True) as session:
        greedy(model, ids, n=48)
        totals = rt.totals()
    session.trace.save(tmp_path / "trace")
    acc = read_accesses([tmp_path / "trace.safetensors"])
    assert acc.tokens == 48  # the prompt token and 47 generated ones went through the model
    rows = run(SimConfig(acc, (budget,), (policy, "lru")))
    simulated = {r["policy"]: r for r in rows}
    assert (totals["hits"], totals["misses"]) == (simulated[policy]["hits"], simulated[policy]["misses"])
    assert totals["loads"] == totals["misses"]  # every miss loaded once, nothing else
    assert totals["misses"] > acc.layers * budget  # the budget forced evictions
    assert simulated[policy]["hits"] != simulated["lru"]["hits"]  # and the policy is not LRU here


def test_parse_and_round_trip():
    assert isinstance(parse_policy("s3fifo"), S3FIFOResidency)
    assert isinstance(parse_policy("arc"), ARCResidency)
    assert isinstance(moectl.load_policy({"type": "arc"}), ARCResidency)
    assert parse_policy("s3fifo").to_dict()["type"] == "s3fifo"


def test_prompt_streams_then_the_cache_restarts_from_what_is_resident():
    model = moectl.tiny("olmoe")
    ids = torch.randint(3, 200, (1, 6), generator=torch.Generator().manual_seed(0))
    with offload(model, 3, "s3fifo", store="host") as rt:
        greedy(model, ids, n=8)
        for module in rt.modules:
            cache = module.policy.caches[module.layer]
            assert set(cache.resident) == set(module.res.where)
            assert len(module.res.where) <= 3
