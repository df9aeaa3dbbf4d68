"""The engine's repeats row kind and a caller's own routing objects (``Routing.of``).

A request with ``repeats = K`` takes K rows; its copies' next-token distributions are averaged in
probability space and one token is fed to all of them. Identical copies decode as one row does;
copies with request-keyed Gumbel noise decode the same in a mixed batch as alone; an unregistered
routing object is accepted in process while a routing *name* must still be registered.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import moectl
from moectl import ExpertMask
from moectl.engine import Engine, EngineConfig, Routing, SamplingParams
from moectl.engine.repeats import combine, expand, rows_of
from moectl.ensemble.roe_config import RoEConfig
from moectl.errors import ConfigError
from moectl.eval.request_noise import KeyedGumbel, request_policies
from moectl.routing.gumbel import GumbelTopK

PROMPTS = ["The history of the city of", "def f(x):", "a", "Photosynthesis converts sunlight into"]


@functools.cache
def _loaded():
    model, tok, _ = moectl.load("tiny:olmoe", dtype="float32")
    return model, tok, moectl.inspect(model)


def test_combine_averages_each_requests_copies_in_probability_space():
    torch.manual_seed(0)
    copies = [1, 3, 2, 1]
    logits = torch.randn(sum(copies), 11)
    out = combine(logits, copies)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[3], logits[6])
    for i, rows in ((1, [1, 2, 3]), (2, [4, 5])):
        mean = logits[rows].softmax(-1).mean(0)
        torch.testing.assert_close(out[i].exp(), mean)
        torch.testing.assert_close(
            out[i], torch.logsumexp(logits[rows].log_softmax(-1), 0) - math.log(len(rows))
        )
    assert combine(logits[:2], [1, 1]) is not None and torch.equal(combine(logits[:2], [1, 1]), logits[:2])
    assert rows_of(copies, [1, 3]) == [1, 2, 3, 6]
    assert expand(torch.tensor([7, 8, 9, 10]), copies).tolist() == [7, 8, 8, 8, 9, 9, 10]
    with pytest.raises(ValueError, match="rows of logits"):
        combine(logits[:3], copies)


def test_identical_copies_decode_as_one_row():
    """K copies of a stateless mask: the same distribution K times, so the same tokens and switch rate."""
    model, tok, info = _loaded()
    mask = ExpertMask.everywhere(info, [0, 1, 2, 3, 4, 5])
    mask.bind(info)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    one = Engine(model, tok, EngineConfig(max_batch=4), info=info).generate(
        PROMPTS, params, Routing.of([mask])
    )
    engine = Engine(model, tok, EngineConfig(max_batch=6, log_forwards=True), info=info)
    three = engine.generate(PROMPTS, params, Routing.of([mask], repeats=3))
    assert [c.token_ids for c in three] == [c.token_ids for c in one]
    assert [c.switch_rate for c in three] == pytest.approx([c.switch_rate for c in one])
    assert max(rows for _, rows in engine.forward_log) == 6, "two requests of 3 rows at a time"


def _keyed(info, prompt_ids: list[int], k: int) -> Routing:
    own = request_policies([KeyedGumbel(GumbelTopK(2.0, seed=7))], f"{sum(prompt_ids):016x}", k)
    for policy in own:
        policy.bind(info)
    return Routing.of(own, repeats=k, owned=True)


def test_noisy_copies_in_a_mixed_batch_decode_as_alone():
    """Requests of 3 noisy copies, of 2 and plain ones in one batch: each decodes what it does alone;
    the copies' noise is active (not the plain model's tokens)."""
    model, tok, info = _loaded()
    ids = [tok([p])["input_ids"][0].tolist() for p in PROMPTS]
    routings = [_keyed(info, ids[0], 3), None, _keyed(info, ids[2], 2), _keyed(info, ids[3], 3)]
    params = SamplingParams(max_tokens=10, ignore_eos=True, seed=3)
    mixed = Engine(model, tok, EngineConfig(max_batch=9), info=info).generate(ids, params, routings)
    for prompt, routing, got in zip(ids, routings, mixed, strict=True):
        fresh = None if routing is None else _keyed(info, prompt, routing.repeats)
        alone = Engine(model, tok, EngineConfig(max_batch=3), info=info).generate([prompt], params, fresh)[0]
        assert got.token_ids == alone.token_ids
    plain = Engine(model, tok, EngineConfig(max_batch=4), info=info).generate(ids, params)
    assert any(a.token_ids != b.token_ids for a, b in zip(mixed, plain, strict=True))


def test_routing_objects_and_names():
    model, tok, info = _loaded()
    engine = Engine(model, tok, EngineConfig(max_batch=2), info=info)
    with pytest.raises(ConfigError, match="unknown routing 'math'"):
        engine.submit("a", SamplingParams(max_tokens=2), routing="math")  # names must be registered
    with pytest.raises(ConfigError, match="needs more rows than max_batch"):
        engine.submit("a", SamplingParams(max_tokens=2), routing=Routing.of([], repeats=3))
    with pytest.raises(ConfigError, match="not both"):
        Routing.of([], repeats=2, roe=RoEConfig(K=2, tau=1.0))
    with pytest.raises(ConfigError, match="one params and one routing per prompt"):
        engine.generate(["a", "b"], SamplingParams(max_tokens=2), [None])
