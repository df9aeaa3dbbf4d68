"""A policy written inline as JSON is read as a policy file's contents would be (#41: ``moectl serve
--help`` showed ``{"type": "gumbel", "tau": 0.5}`` as a ``--routing`` value and the verb refused it)."""

from __future__ import annotations

import json

import pytest

import moectl
from moectl.engine import Engine, EngineConfig, SamplingParams
from moectl.errors import ConfigError
from moectl.routing import GumbelTopK, load_policy
from moectl.routing.pool import DocumentPool


def test_inline_json_equals_the_same_file(tmp_path):
    _, _, info = moectl.load("tiny:olmoe")
    spec = [{"type": "document_pool", "d": 4}, {"type": "gumbel", "tau": 0.3, "seed": 2}]
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(spec))
    inline = load_policy(json.dumps(spec), info)
    from_file = load_policy(path, info)
    assert [repr(p) for p in inline] == [repr(p) for p in from_file]
    assert isinstance(inline[0], DocumentPool) and isinstance(inline[1], GumbelTopK)
    assert isinstance(load_policy(' {"type": "gumbel", "tau": 0.5}', info), GumbelTopK)


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ('{"type": "gumbel", "tau": }', "not valid JSON (Expecting value at character 26)"),
        ('{"type": "nope"}', "unknown policy type 'nope'"),
        ('{"type": "gumbel", "tau": "x"}', "gumbel 'tau' must be a number"),
        ("[" * 5000, "not valid JSON"),
    ],
)
def test_a_bad_inline_policy_is_one_line_naming_it(spec, words):
    _, _, info = moectl.load("tiny:olmoe")
    with pytest.raises(ConfigError) as refused:
        load_policy(spec, info)
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_an_inline_routing_serves_as_its_file_would():
    model, tok, _ = moectl.load("tiny:olmoe", dtype="float32")
    spec = {"type": "expert_mask", "experts": {"0": [0, 1, 2, 3]}}
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with Engine(model, tok, EngineConfig(), routings={"a": json.dumps(spec), "b": spec}) as engine:
        a, b = engine.generate(["abc", "abc"], params, routing=["a", "b"])
    assert a.token_ids == b.token_ids and a.routing == "a"
