"""moectl's policies conform to the protocols of ``moectl.routing.protocols``, and the code that used
to probe policies with ``hasattr`` decides by those protocols."""

from __future__ import annotations

import pytest
import torch

import moectl
from moectl.adapters.inspect import inspect
from moectl.eval.request_noise import keyed_policies, needs_isolation, reseed
from moectl.offload.residency import LRUPolicy, OptionPolicy
from moectl.options.controller import build_controller
from moectl.options.policy import ControllerPolicy
from moectl.options.random_options import RandomOptions
from moectl.routing import DocumentPool, ExpertMask, GumbelTopK
from moectl.routing.policy_files import load_policy, routing_policies
from moectl.routing.protocols import (
    MergingPolicy,
    ResettablePolicy,
    RoutingPolicy,
    RoutingSource,
    SeededPolicy,
    SequencePolicy,
    carries_weights,
    renorm_of,
)
from moectl.routing.routing_state import Policy
from moectl.routing.routing_state import SequencePolicy as OldSequencePolicy


@pytest.fixture(scope="module")
def info():
    model, _, _ = moectl.load("tiny:olmoe")
    return inspect(model)


def test_old_import_paths_are_the_protocols():
    assert Policy is RoutingPolicy and OldSequencePolicy is SequencePolicy


def test_each_policy_class_conforms(info):
    controller = ControllerPolicy(build_controller(info, 4))
    mask = ExpertMask.from_lists(info, {0: [0, 1, 2, 3]})
    expected = [  # (policy, the protocols it must (True) and must not (False) satisfy)
        (controller, dict(seq=True, reset=True, seeded=True, merging=True, source=False)),
        (GumbelTopK(0.5, seed=1), dict(seq=True, reset=False, seeded=True, merging=False, source=False)),
        (RandomOptions(4, seed=1), dict(seq=False, reset=False, seeded=True, merging=False, source=False)),
        (DocumentPool(4), dict(seq=True, reset=False, seeded=False, merging=False, source=False)),
        (mask, dict(seq=False, reset=False, seeded=False, merging=False, source=False)),
    ]
    for policy, want in expected:
        assert isinstance(policy, RoutingPolicy), policy
        got = dict(
            seq=isinstance(policy, SequencePolicy),
            reset=isinstance(policy, ResettablePolicy),
            seeded=isinstance(policy, SeededPolicy),
            merging=isinstance(policy, MergingPolicy),
            source=isinstance(policy, RoutingSource),
        )
        assert got == want, type(policy).__name__
    for residency in (LRUPolicy(), OptionPolicy(4)):
        assert isinstance(residency, RoutingSource) and not isinstance(residency, RoutingPolicy)


def test_a_user_policy_needs_only_bind_and_apply(info):
    class Mine:
        def bind(self, info) -> None:
            pass

        def apply(self, state) -> None:
            pass

    mine = Mine()
    assert load_policy(mine) is mine
    assert renorm_of(mine) == "pruned" and renorm_of(ExpertMask.everywhere(info, range(4), renorm="stock")) == "stock"
    assert routing_policies([mine], None, info) == [mine]
    assert not needs_isolation(mine)

    class HalfPolicy:  # apply without bind: not a policy (it used to pass load_policy's probe)
        def apply(self, state) -> None:
            pass

    with pytest.raises(TypeError, match="cannot load a policy"):
        load_policy(HalfPolicy())


def test_a_merging_policy_is_attached_only_while_pending(info):
    model = torch.nn.Linear(1, 1)

    class Pending:
        def __init__(self, pending) -> None:
            self.pending, self.attached = pending, []

        def bind(self, info) -> None:
            pass

        def apply(self, state) -> None:
            pass

        def attach(self, model) -> None:
            self.attached.append(model)

    waiting = Pending("runs/ctrl")
    assert carries_weights(waiting) and not carries_weights(Pending(None))
    assert routing_policies([waiting], model, info) == [waiting]
    assert waiting.attached == [model]


def test_isolation_follows_the_seeded_protocol(info):
    sampling = ControllerPolicy(build_controller(info, 4), mode="sample", seed=3)
    greedy = ControllerPolicy(build_controller(info, 4), mode="greedy", seed=3)
    gumbel = GumbelTopK(0.5, seed=2)
    assert needs_isolation(sampling) and needs_isolation(gumbel) and needs_isolation(RandomOptions(4))
    assert not needs_isolation(greedy)  # a greedy controller draws nothing
    assert not needs_isolation(DocumentPool(4))  # has a mode ("causal"), no seed
    assert not any(needs_isolation(p) for p in keyed_policies([gumbel, RandomOptions(4)]))

    sampling._option[0] = torch.ones(1, 4, dtype=torch.bool)  # sequence state a reseed must clear
    reseed([sampling, gumbel], "ab" * 16)
    assert sampling.seed != 3 and 0 not in sampling.current_option  # ResettablePolicy: reset(seed=)
    assert gumbel.seed != 2  # seed set; bind reseeds
