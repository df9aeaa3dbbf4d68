"""A request's score and generation do not depend on batch size or request order, under random routing.

Gumbel noise and random options are keyed by request and position (``eval/request_noise.py``); a
sampling controller runs each request alone, reseeded from its key; RoE's noise is keyed by
(sample, position). So batch sizes 1 and 8 and a shuffled order give the same numbers, through
the lm-eval backend (``MoectlLM.loglikelihood`` / ``generate_until``).
"""

from __future__ import annotations

import random

import pytest
import torch
from lm_eval.api.instance import Instance

from _eval_data import tiny_eval_env
from moectl.eval.lm_backend import MoectlLM
from moectl.eval.multiple_choice import mc_items
from moectl.models.load import ByteTokenizer

GUMBEL = {"type": "gumbel", "tau": 1.0, "seed": 3}
ROUTINGS = {
    "gumbel": {"policy": GUMBEL},
    "pool+gumbel": {"policy": [{"type": "document_pool", "d": 4}, {"type": "gumbel", "tau": 0.5, "seed": 1}]},
    "random_options": {"policy": {"type": "random_options", "k_hat": 4, "seed": 1}},
    "roe": {"roe": "K=3,tau=1.0"},
}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    yield from tiny_eval_env(tmp_path_factory)


@pytest.fixture(scope="module")
def pairs(env):
    cache, _, _ = env
    return [pair for item in mc_items("arc_easy", cache) for pair in item.requests]


@pytest.fixture(scope="module")
def controller_dir(env, tmp_path_factory):
    from moectl.options import ControllerPolicy, build_controller

    _, _, info = env
    folder = tmp_path_factory.mktemp("ctrl") / "ctrl"
    ControllerPolicy(build_controller(info, k_hat=4)).save(folder)  # mode "sample": draws per token
    return folder


def _loglikelihoods(lm: MoectlLM, pairs: list, order: list[int]) -> tuple[torch.Tensor, list[bool]]:
    """Scores in pair order, the requests given to the backend in ``order``."""
    requests = [Instance("loglikelihood", {}, pairs[i], n) for n, i in enumerate(order)]
    results = lm.loglikelihood(requests)
    values, greedy = [0.0] * len(pairs), [False] * len(pairs)
    for (value, flag), i in zip(results, order, strict=True):
        values[i], greedy[i] = value, flag
    return torch.tensor(values, dtype=torch.float64), greedy


def _check_invariant(model, pairs: list, routing: dict) -> torch.Tensor:
    order = list(range(len(pairs)))
    shuffled = order[:]
    random.Random(0).shuffle(shuffled)
    runs = [
        _loglikelihoods(MoectlLM(model, ByteTokenizer(), batch_size=bs, **routing), pairs, o)
        for bs, o in ((8, order), (1, order), (8, shuffled), (3, shuffled[::-1]))
    ]
    for values, greedy in runs[1:]:
        torch.testing.assert_close(values, runs[0][0], atol=1e-5, rtol=0)
        assert greedy == runs[0][1]
    return runs[0][0]


@pytest.mark.parametrize("name", list(ROUTINGS))
def test_scores_ignore_batch_size_and_order(env, pairs, name):
    _, model, _ = env
    noisy = _check_invariant(model, pairs, ROUTINGS[name])
    plain, _ = _loglikelihoods(MoectlLM(model, ByteTokenizer(), batch_size=8), pairs, list(range(len(pairs))))
    assert (noisy - plain).abs().max() > 1e-3, "the routing randomness is active"


def test_sampling_controller_scores_ignore_batch_size_and_order(env, pairs, controller_dir):
    _, model, _ = env
    subset = pairs[:16]  # a request per forward: keep it short
    scores = _check_invariant(model, subset, {"controller": str(controller_dir)})
    assert torch.isfinite(scores).all()


def test_a_request_is_routed_by_its_own_key(env, pairs):
    """Two different seeds give different scores; the same seed on a fresh backend the same ones."""
    _, model, _ = env
    order = list(range(len(pairs)))
    first, _ = _loglikelihoods(MoectlLM(model, ByteTokenizer(), policy=GUMBEL), pairs, order)
    again, _ = _loglikelihoods(MoectlLM(model, ByteTokenizer(), policy=GUMBEL), pairs, order)
    other, _ = _loglikelihoods(MoectlLM(model, ByteTokenizer(), policy={**GUMBEL, "seed": 4}), pairs, order)
    assert torch.equal(first, again)
    assert (first - other).abs().max() > 1e-3


@pytest.mark.parametrize("routing", [{"policy": GUMBEL}, {"roe": "K=2,tau=1.0"}, {"controller": None}])
@pytest.mark.parametrize("gen", [{"do_sample": False}, {"do_sample": True, "temperature": 1.0}])
def test_generation_ignores_batch_size_and_order(env, controller_dir, routing, gen):
    _, model, _ = env
    if "controller" in routing:
        routing = {"controller": str(controller_dir)}
    contexts = ["Q: Tom has 2 apples.\nA:", "Q: hi\nA:", "The cat", "Q: Tom has 2 apples.\nA: He", "x"]
    kwargs = {"until": ["\n\n"], "max_gen_toks": 5, **gen}
    outs = []
    for bs, order in ((4, [0, 1, 2, 3, 4]), (1, [4, 2, 0, 3, 1])):
        lm = MoectlLM(model, ByteTokenizer(), batch_size=bs, **routing)
        texts = lm.generate_until([Instance("generate_until", {}, (contexts[i], kwargs), n) for n, i in enumerate(order)])
        outs.append({i: t for i, t in zip(order, texts, strict=True)})
    assert outs[0] == outs[1]
    assert any(outs[0].values()), "something was generated"
