"""``option:K`` as a request's routing: outputs unchanged, the switch rate the router's at k-hat = K.

Before, ``--routing opt8=option:8`` was accepted, changed nothing and reported the router's switch
rate at k-hat = top-k (#41). Now the engine keeps ω by TE-MoE §2.2's lens for those rows, and the
figure equals ``moectl.switch_rate(trace, k_hat=K)`` of the request's own trace.
"""

from __future__ import annotations

import pytest

import moectl
from moectl.engine import Engine, EngineConfig, SamplingParams
from moectl.errors import ConfigError
from moectl.routing.option_lens import OptionLens

PROMPTS = ["The mixture of experts routes each token", "def f(x):", "Once upon a time"]


def test_option_k_changes_no_output_and_reports_its_own_switch_rate():
    model, tok, _info = moectl.load("tiny:olmoe", dtype="float32")
    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0, seed=1)
    routings = {"opt4": "option:4", "opt6": "option:6"}
    order = [(routing, i) for routing in (None, "opt4", "opt6") for i in range(len(PROMPTS))]
    with Engine(model, tok, EngineConfig(record=True, max_batch=9), routings=routings) as engine:
        plain = engine.generate(PROMPTS, params)
        # all three routings in one batch: each row is counted by its own lens
        mixed = engine.generate([PROMPTS[i] for _, i in order], params, routing=[r for r, _ in order])
    got = dict(zip(order, mixed, strict=True))
    for i, done in enumerate(plain):
        assert done.switch_rate == pytest.approx(moectl.switch_rate(done.trace).mean, abs=1e-6)
        rates = []
        for routing, k_hat in ((None, None), ("opt4", 4), ("opt6", 6)):
            other = got[(routing, i)]
            assert other.token_ids == done.token_ids, routing  # the lens changes no output
            want = moectl.switch_rate(other.trace, k_hat=k_hat).mean
            assert other.switch_rate == pytest.approx(want, abs=1e-6), routing
            rates.append(other.switch_rate)
        assert rates[0] >= rates[1] >= rates[2]  # a wider option is renewed less often


def test_k_hat_below_top_k_is_refused_naming_both():
    model, tok, info = moectl.load("tiny:olmoe", dtype="float32")
    with pytest.raises(ConfigError, match=r"option:1: k-hat must be between top-k = 2 and the 8 experts"):
        Engine(model, tok, routings={"o": "option:1"})
    with pytest.raises(ConfigError, match="between top-k"):
        OptionLens(9).bind(info)


def test_serve_offload_option_residency_still_routes_as_the_model():
    """The residency policy's routing is the lens: under offloading it changes nothing either."""
    from moectl.offload.offload_config import OffloadConfig

    model, tok, _ = moectl.load("tiny:olmoe", dtype="float32")
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    with Engine(model, tok) as engine:
        want = [c.token_ids for c in engine.generate(PROMPTS[:2], params)]
    offload = OffloadConfig(budget=4, policy="option:4", store="host")
    with Engine(model, tok, EngineConfig(offload=offload)) as engine:
        got = [c.token_ids for c in engine.generate(PROMPTS[:2], params)]
    assert got == want
