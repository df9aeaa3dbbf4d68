"""A residency policy is not a routing (found by benchmarks/serve_learned_policy.py): ``reroute``,
``lru``, ``s3fifo``, ``arc`` as a server ``--routing`` loaded and silently did nothing, so they are
refused in one line naming ``--residency``; ``option:K`` and ``static`` (a mask) stay routings."""

from __future__ import annotations

import pytest

import moectl
from moectl.adapters import inspect
from moectl.engine.routings import resolve
from moectl.errors import ConfigError


@pytest.fixture(scope="module")
def tiny():
    model = moectl.load("tiny:olmoe").model
    return model, inspect(model)


@pytest.mark.parametrize("spec", [{"type": "reroute", "tol": 0.1}, "lru", {"type": "s3fifo"}, {"type": "arc"}])
def test_a_residency_policy_is_refused_as_a_routing(tiny, spec):
    model, info = tiny
    with pytest.raises(ConfigError, match="--residency"):
        resolve("r", spec, model, info)


def test_option_and_static_stay_routings(tiny):
    model, info = tiny
    assert resolve("o", "option:4", model, info).policies
    static = {"type": "static", "everywhere": [0, 1, 2, 3]}
    assert resolve("s", static, model, info).policies
