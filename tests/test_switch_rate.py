"""Switch rate (TE-MoE §2.2) on hand-made traces with known answers, and on a model."""

from __future__ import annotations

import pytest
import torch

from conftest import random_ids
from moectl.metrics.switch_rate import mask_switches, router_option_masks, switch_rate
from moectl.routing import RoutingTrace, route


def _trace(probs: torch.Tensor, chosen: torch.Tensor, calls: list[int] | None = None) -> RoutingTrace:
    """One-layer trace of [B, T, E] probs and [B, T, k] chosen, recorded in calls of the given lengths."""
    b, t, _ = probs.shape
    calls = calls or [t]
    trace = RoutingTrace(1)
    start = 0
    for i, length in enumerate(calls):
        trace.begin_call(0 if i == 0 else start, torch.ones(b, length, dtype=torch.bool))
        trace.record(0, probs[:, start : start + length], chosen[:, start : start + length], None)
        start += length
    return trace


def _probs(order_per_t: list[list[int]], e: int = 4) -> torch.Tensor:
    """Probabilities whose ranking at each position follows ``order_per_t``."""
    probs = torch.zeros(1, len(order_per_t), e)
    for t, order in enumerate(order_per_t):
        for rank, expert in enumerate(order):
            probs[0, t, expert] = 0.5 / (rank + 1)
    return probs / probs.sum(-1, keepdim=True)


def test_k_hat_equals_k_counts_changes_of_activated_set():
    chosen = torch.tensor([[[0], [0], [1], [1], [1], [2]]])
    probs = _probs([[0, 1, 2, 3], [0, 1, 2, 3], [1, 0, 2, 3], [1, 0, 2, 3], [1, 2, 0, 3], [2, 1, 0, 3]])
    report = switch_rate(_trace(probs, chosen), k_hat=1, region="all")
    assert report.mean == pytest.approx(2 / 5)
    assert report.steps == 5


def test_k_hat_above_k_persists_until_activated_expert_leaves():
    # option at t0 = {0, 1}; chosen stays inside until t3 (expert 2): one switch, option {2, 3} then holds
    chosen = torch.tensor([[[0], [1], [0], [2], [2], [3]]])
    probs = _probs([[0, 1, 2, 3], [1, 0, 2, 3], [0, 2, 1, 3], [2, 3, 0, 1], [2, 0, 1, 3], [3, 1, 0, 2]])
    trace = _trace(probs, chosen)
    report = switch_rate(trace, k_hat=2, region="all")
    assert report.mean == pytest.approx(1 / 5)
    masks = router_option_masks(probs, trace.chosen_mask(0), k_hat=2)
    assert masks[0, 0].nonzero().flatten().tolist() == [0, 1]
    assert masks[0, 3].nonzero().flatten().tolist() == [2, 3]
    assert masks[0, 5].nonzero().flatten().tolist() == [2, 3]


def test_option_always_contains_activated_experts():
    # a biased router may activate an expert that is not among the top-k-hat of p
    chosen = torch.tensor([[[3], [3]]])
    probs = _probs([[0, 1, 2, 3], [0, 1, 2, 3]])
    masks = router_option_masks(probs, _trace(probs, chosen).chosen_mask(0), k_hat=2)
    assert masks[0, 0].nonzero().flatten().tolist() == [0, 3]


def test_generated_region_starts_at_last_prompt_token():
    chosen = torch.tensor([[[0], [1], [2], [2], [3], [3]]])
    probs = _probs([[e, *[x for x in range(4) if x != e]] for e in [0, 1, 2, 2, 3, 3]])
    trace = _trace(probs, chosen, calls=[3, 1, 1, 1])  # prompt of 3, then 3 decoding steps
    assert trace.prompt_len.tolist() == [3]
    report = switch_rate(trace, k_hat=1, region="generated")
    # measured positions 2..5 -> chosen 2,2,3,3: one switch in 3 steps
    assert report.mean == pytest.approx(1 / 3)
    assert switch_rate(trace, k_hat=1, region="all").mean == pytest.approx(3 / 5)


def test_mask_switches_counts_valid_steps_only():
    a, b = torch.tensor([1, 1, 0, 0]).bool(), torch.tensor([0, 1, 1, 0]).bool()
    masks = torch.stack([a, a, b, b, a])[None]
    valid = torch.tensor([[True, True, True, True, False]])
    switches, steps = mask_switches(masks, valid)
    assert switches.tolist() == [1] and steps.tolist() == [3]


def test_switch_rate_from_recorded_masks():
    trace = RoutingTrace(1)
    allowed = torch.zeros(1, 4, 4, dtype=torch.bool)
    allowed[0, :2, :2] = True
    allowed[0, 2:, 2:] = True
    trace.begin_call(0, torch.ones(1, 4, dtype=torch.bool))
    trace.record(0, torch.full((1, 4, 4), 0.25), torch.tensor([[[0], [1], [2], [3]]]), allowed)
    assert switch_rate(trace, source="allowed", region="all").mean == pytest.approx(1 / 3)


@torch.no_grad()
def test_on_model_k_hat_bounds(olmoe):
    with route(olmoe, record=True) as session:
        olmoe(random_ids(batch=3, length=20))
    trace = session.trace
    everything = switch_rate(trace, k_hat=8, region="all")
    assert everything.mean == 0.0  # an option of all experts never has to change
    direct = trace.chosen[0].sort(-1).values
    changes = (direct[:, 1:] != direct[:, :-1]).any(-1).float().mean(1)
    k_equal = switch_rate(trace, k_hat=2, region="all")
    torch.testing.assert_close(torch.tensor(k_equal.per_sequence_layer)[:, 0], changes)
    assert 0 <= switch_rate(trace, k_hat=4, region="all").mean <= k_equal.mean
