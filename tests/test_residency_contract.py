"""Serving residency policies derive from the abstract ``ResidencyPolicy`` (not from LRU), say
whether they pin a set (``pins``), and ``serve_offload`` reads ``pins`` to report a switch rate."""

from __future__ import annotations

import pytest
import torch

from moectl.adapters.inspect import inspect
from moectl.models.load import load_model
from moectl.offload.offload_config import OffloadConfig
from moectl.offload.residency import ControllerResidency, LRUPolicy, ResidencyPolicy, parse_policy
from moectl.options.controller import build_controller
from moectl.options.policy import ControllerPolicy
from moectl.routing.policy_config import policy_class
from moectl.server.offload_batch import serve_offload

torch.set_num_threads(1)

PINS = {"lru": False, "pregate": False, "s3fifo": True, "arc": True, "reroute:0.1": True, "option:4": True}


def test_every_residency_policy_is_a_residency_policy_not_an_lru():
    for spec, pins in PINS.items():
        policy = parse_policy(spec)
        assert isinstance(policy, ResidencyPolicy) and policy.pins is pins, spec
        assert isinstance(policy, LRUPolicy) is (spec == "lru"), spec
    static = policy_class("static")({0: [0, 1]})
    assert isinstance(static, ResidencyPolicy) and not isinstance(static, LRUPolicy) and static.pins
    model, _ = load_model("tiny:olmoe")
    residency = ControllerResidency(ControllerPolicy(build_controller(inspect(model), 4)))
    assert residency.pins and not isinstance(residency, LRUPolicy) and residency.k_hat == 4


def test_the_contract_is_abstract():
    class Half(ResidencyPolicy):  # no before, no pins
        def config_fields(self):
            return {}

    with pytest.raises(TypeError, match="abstract"):
        Half()


class _Pinning(LRUPolicy):
    """LRU's residency (nothing pinned) that claims to pin: the runner must take its word."""

    pins = True


@pytest.mark.parametrize("policy, rate", [(LRUPolicy(), None), (_Pinning(), 0.0)])
def test_serve_offload_reads_pins_for_the_switch_rate(policy, rate):
    model, tok = load_model("tiny:olmoe")
    r = serve_offload(model, tok, ["hello"], OffloadConfig(0.5, policy, "host"), 3, progress=False)
    assert r["switches"] == 0 and r["switch_rate"] == rate
