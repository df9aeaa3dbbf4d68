"""``reroute:TOL``: the swap rule by hand, TOL 0 changes nothing, TOL 1 serves from the resident set."""

from __future__ import annotations

import pytest
import torch
from tests._serve_helpers import greedy

import moectl
from moectl.offload.reroute import RerouteResidency, reroute
from moectl.offload.residency import parse_policy
from moectl.offload.runtime import offload


def _ids(mask: torch.Tensor) -> list[int]:
    return mask.nonzero().flatten().tolist()


@pytest.mark.parametrize(
    "tol, expected, swapped",
    [
        (0.15, [0, 1], 0),  # 0.2 < 0.4 - 0.15 and 0.1 < 0.3 - 0.15: nothing within tolerance
        (0.19, [0, 1], 0),
        (0.21, [2, 3], 2),  # 0.2 >= 0.4 - 0.21 and 0.1 >= 0.3 - 0.21: both swapped
        (0.25, [2, 3], 2),
    ],
)
def test_both_chosen_experts_missing(tol, expected, swapped):
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    allowed, n = reroute(probs, torch.tensor([0, 1]), torch.tensor([False, False, True, True]), tol)
    assert (_ids(allowed), n) == (expected, swapped)


def test_the_best_missing_expert_pairs_with_the_best_candidate():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    resident = torch.tensor([False, True, True, False])  # 1 chosen and resident; 2 the only candidate
    assert _ids(reroute(probs, torch.tensor([0, 1]), resident, 0.3)[0]) == [0, 1]  # 0.15 < 0.5 - 0.3
    assert _ids(reroute(probs, torch.tensor([0, 1]), resident, 0.4)[0]) == [1, 2]
    assert reroute(probs, torch.tensor([1, 2]), resident, 1.0)[1] == 0  # all resident: unchanged


def _serve(model, policy: str, n: int = 40):
    ids = torch.tensor([[17]])  # one prompt token: every step is a decoding step
    with offload(model, 4, policy, store="host") as rt, moectl.route(model, rt.policy.routing(rt.info)):
        out = greedy(model, ids, n=n)
        return out, rt.totals(), rt.policy


def test_tolerance_zero_is_s3fifo_and_one_serves_from_the_resident_set():
    model = moectl.tiny("olmoe")  # 8 experts, top-2, 3 MoE layers
    out_s3, totals_s3, _ = _serve(model, "s3fifo")
    out_0, totals_0, policy_0 = _serve(model, "reroute:0")
    assert torch.equal(out_0, out_s3) and policy_0.rerouted == 0
    assert (totals_0["hits"], totals_0["misses"]) == (totals_s3["hits"], totals_s3["misses"])
    _, totals_1, policy_1 = _serve(model, "reroute:1")
    assert policy_1.rerouted > 0
    # once a layer holds 4 experts every token finds 2 resident ones: only the first fills miss
    assert totals_1["misses"] <= 3 * 4 < totals_s3["misses"]


def test_parse_and_bad_tolerance():
    policy = parse_policy("reroute:0.05")
    assert isinstance(policy, RerouteResidency) and policy.to_dict()["tol"] == 0.05
    assert isinstance(moectl.load_policy({"type": "reroute", "tol": 0.1}), RerouteResidency)
    with pytest.raises(ValueError, match=r"tolerance TOL in \[0, 1\]"):
        parse_policy("reroute:2")
    with pytest.raises(ValueError, match=r"reroute needs a tolerance, as reroute:0\.05"):
        parse_policy("reroute:x")


def test_grouped_routers_are_refused():
    model = moectl.tiny("deepseek_v3")
    with pytest.raises(ValueError, match="rerouting supports ungrouped softmax"):
        RerouteResidency(0.1).router.bind(moectl.inspect(model))


def test_an_expert_another_policy_disallowed_is_never_swapped_in():
    from types import SimpleNamespace

    from moectl.routing.routing_state import RouteContext, RoutingState

    layer = moectl.inspect(moectl.tiny("olmoe")).layers[0]  # 8 experts, top-2
    policy = RerouteResidency(1.0)
    policy.sets[0] = SimpleNamespace(where={0: 0, 3: 1})  # experts 0 and 3 resident
    logits = torch.full((1, 1, 8), float("-inf"))
    logits[0, 0, 0] = 0.0  # p = [1, 0, ..., 0]: the second choice has p = 0, not resident
    allowed = torch.ones(1, 1, 8, dtype=torch.bool)
    allowed[0, 0, 3] = False  # another policy forbids expert 3
    state = RoutingState(0, logits, layer.rule, RouteContext(1, 1), allowed=allowed.clone())
    policy.router.apply(state)
    assert policy.rerouted == 0 and torch.equal(state.allowed, allowed)  # 3 (p - 1 >= 0 - TOL) not taken


def test_rows_of_a_decoding_step_reroute_each_as_one_token_would():
    """A batched decoding step reroutes every row against the shared resident set (it used to act
    only at steps of one row, so with several clients reroute:TOL served as its S3-FIFO base)."""
    from moectl.offload.reroute import reroute_rows

    g = torch.Generator().manual_seed(0)
    for tol in (0.0, 0.05, 0.2, 1.0):
        probs = torch.rand(16, 12, generator=g).softmax(-1)
        chosen = probs.topk(3, dim=-1).indices
        resident = torch.rand(12, generator=g) < 0.5
        picked, swapped = reroute_rows(probs, chosen, resident, tol)
        one = [reroute(p, c, resident, tol) for p, c in zip(probs, chosen, strict=True)]
        assert torch.equal(picked, torch.stack([m for m, _ in one])) and swapped == sum(n for _, n in one)
        assert (picked.sum(-1) == 3).all()


def test_a_batched_decoding_step_is_rerouted():
    from types import SimpleNamespace

    from moectl.routing.routing_state import RouteContext, RoutingState

    layer = moectl.inspect(moectl.tiny("olmoe")).layers[0]  # 8 experts, top-2
    policy = RerouteResidency(1.0)
    policy.sets[0] = SimpleNamespace(where={4: 0, 5: 1, 6: 2})  # experts 4, 5, 6 resident
    logits = torch.tensor([[0.0, 1.0, -1, -1, -2, -2, -3, -3], [1.0, 0.0, -1, -1, -3, -2, -2, -3]]).view(2, 1, 8)
    state = RoutingState(0, logits, layer.rule, RouteContext(2, 1))
    policy.router.apply(state)
    assert policy.rerouted == 4  # both rows' two missing experts, within TOL 1
    assert _ids(state.allowed[0, 0]) == [4, 5] and _ids(state.allowed[1, 0]) == [5, 6]
