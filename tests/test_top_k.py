"""``topk:N`` (#41 item 3): the router's own rule with N experts per token, below and above the
model's k, composed with masks and forced experts; rows of one engine batch with different N each
route as they would alone, and their traces and expert counts keep their own N."""

from __future__ import annotations

import json

import pytest
import torch

import moectl
from moectl.adapters.rules import RouterRule
from moectl.engine import Engine, EngineConfig, SamplingParams
from moectl.engine.engine import encode
from moectl.errors import ConfigError
from moectl.routing import load_policy
from moectl.routing.top_k import TopK

MODEL = "tiny:olmoe"  # top-2 of 8 experts, 3 MoE layers
PROMPT = "The mixture of experts routes each token"


def _routed(model, tok, policies, prompt=PROMPT):
    with moectl.route(model, policies, record=True) as session, torch.no_grad():
        out = model(torch.tensor([encode(tok, prompt)])).logits
    return out, session.trace


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_n_experts_per_token_by_the_families_rule(n):
    model, tok, info = moectl.load(MODEL, dtype="float32")
    _, trace = _routed(model, tok, [TopK(n)])
    rule = info.layers[0].rule
    probs = trace.probs[0][0]
    want = probs.topk(n, dim=-1).indices.sort(-1).values
    assert torch.equal(trace.chosen[0][0].sort(-1).values, want)
    _weights, idx = RouterRule("softmax_topk", n, 8, norm_topk_prob=rule.norm_topk_prob).select(torch.log(probs))
    assert torch.equal(idx.sort(-1).values, want)


def test_n_equal_to_k_is_the_model_and_other_n_change_the_output():
    model, tok, _ = moectl.load(MODEL, dtype="float32")
    plain, _ = _routed(model, tok, [])
    same, _ = _routed(model, tok, ["topk:2"])
    fewer, _ = _routed(model, tok, ["topk:1"])
    assert torch.equal(plain, same) and not torch.allclose(plain, fewer)


def test_composes_with_a_mask_and_forced_experts():
    model, tok, info = moectl.load(MODEL, dtype="float32")
    mask = {"type": "expert_mask", "experts": {str(i): [0, 1, 2, 3, 4, 5] for i in range(3)}}
    force = {"type": "experts", "force": {"1": [7]}}
    _, trace = _routed(model, tok, [mask, TopK(4)])
    assert trace.chosen[0].shape[-1] == 4 and int(trace.chosen[0].max()) <= 5
    _, trace = _routed(model, tok, [force, TopK(3)])
    assert (trace.chosen[1][0] == 7).any(-1).all() and trace.chosen[1].shape[-1] == 3
    with pytest.raises(ConfigError, match="topk:9: MoE layer 0 has 8 experts"):
        load_policy("topk:9", info)
    with pytest.raises(ConfigError, match="topk needs an integer"):
        load_policy("topk:two", info)


@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe", "deepseek_v3", "gpt_oss"])  # renorm or not, grouped, topk→softmax
def test_engine_rows_with_different_n_route_as_alone(family):
    model, tok, info = moectl.load(f"tiny:{family}", dtype="float32")
    routings = {"one": "topk:1", "four": "topk:4", "masked3": json.dumps([{"type": "topk", "n": 3}, {"type": "experts", "omit": {"0": [0]}}])}
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = ["Once upon a time", "def f(x):", "2 + 2 =", "The history of"]
    order = [None, "one", "four", "masked3"]
    with Engine(model, tok, EngineConfig(max_batch=4, record=True), routings=routings) as engine:
        solo = [engine.generate([p], params, routing=r)[0] for p, r in zip(prompts, order, strict=True)]
        engine.expert_counts.start()
        mixed = engine.generate(prompts, params, routing=order)
        engine.expert_counts.stop()
        counts = engine.expert_counts.dump()
    for alone, together, routing in zip(solo, mixed, order, strict=True):
        assert together.token_ids == alone.token_ids, routing
        for layer in range(info.num_moe_layers):
            assert torch.equal(together.trace.chosen[layer], alone.trace.chosen[layer]), (routing, layer)
    assert mixed[1].trace.chosen[0].shape[-1] == 1 and mixed[2].trace.chosen[0].shape[-1] == 4
    for completion, name in zip(mixed, ["default", "one", "four", "masked3"], strict=True):
        entry = counts["routings"][name]
        tokens = completion.prompt_tokens + len(completion.token_ids) - 1
        assert entry["tokens"] == tokens
        n = completion.trace.chosen[0].shape[-1]
        assert all(sum(row) == tokens * n for row in entry["counts"]), name  # each row's own N, no padding
