"""Offloaded experts: same tokens as in memory, budget respected, hand-checked LRU, exact traffic."""

from __future__ import annotations

import copy

import pytest
import torch

import moectl
from _serve_helpers import greedy, prompt
from moectl.metrics.switch_rate import router_option_masks
from moectl.offload import offload
from moectl.offload.runtime import BudgetError

torch.set_num_threads(1)


def _expert_params(model) -> dict[str, torch.Tensor]:
    return {
        f"{layer.index}.{n}": p.detach().clone()
        for layer in moectl.inspect(model).layers
        for n, p in layer.block.experts.named_parameters(recurse=False)
    }


def _max_resident(rt) -> list[int]:
    """Install hooks recording the largest resident set seen after every experts forward."""
    seen = [0] * len(rt.modules)

    def hook(i):
        def fn(module, args, output):
            seen[i] = max(seen[i], len(module.res.where))
            assert module.res.slots["down_proj"].shape[0] == rt.budget[i]

        return fn

    for i, m in enumerate(rt.modules):
        m.register_forward_hook(hook(i))
    return seen


@pytest.mark.parametrize(
    ("family", "policy", "store"),
    [
        ("olmoe", "lru", "disk"),
        ("olmoe", "option:3", "host"),
        ("qwen2_moe", "lru", "host"),
        ("qwen2_moe", "option:3", "disk"),
        ("gpt_oss", "lru", "disk"),
        ("gpt_oss", "option:2", "disk"),
    ],
)
def test_offloaded_generation_equals_in_memory(family, policy, store, tmp_path):
    model = moectl.tiny(family)
    ids = prompt()
    reference = greedy(model, ids)
    before = _expert_params(model)
    budget = 3 if policy == "option:3" else 2  # of 8 experts, top-k 2: misses are certain
    with offload(model, budget, policy, store=store, store_dir=tmp_path / "store") as rt:
        seen = _max_resident(rt)
        out = greedy(model, ids)
        totals = rt.totals()
        decode_loads = [s for s, _, _ in rt.events() if rt.step_tokens[s - 1] == 1]
    assert torch.equal(out, reference)
    assert max(seen) == budget  # filled, never above the budget
    assert totals["loads"] > 0 and decode_loads, "the budget must force loads while decoding"
    after = _expert_params(model)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)  # restored bit for bit
    assert torch.equal(greedy(model, ids), reference)


def test_option_residency_follows_router_option_masks():
    """With budget = k-hat the resident set after each step is the switch-rate metric's option."""
    model, k_hat = moectl.tiny("olmoe"), 3
    ids = prompt(1, length=5)
    with moectl.route(model, record=True) as session:
        greedy(model, ids)
    trace = session.trace
    p = ids.shape[1]
    with offload(model, k_hat, f"option:{k_hat}", store="host") as rt:
        resident: list[list[list[int]]] = [[] for _ in rt.modules]

        def hook(i):
            def fn(module, args, output):
                resident[i].append(module.res.resident)

            return fn

        for i, m in enumerate(rt.modules):
            m.register_forward_hook(hook(i))
        greedy(model, ids)
        loads, switches = rt.totals()["loads"], rt.totals()["switches"]
    total_switches = 0
    for layer in range(len(resident)):
        masks = router_option_masks(
            trace.probs[layer].float(), trace.chosen_mask(layer), k_hat, torch.tensor([p - 1])
        )[0]
        expected = [masks[t].nonzero().flatten().tolist() for t in range(p - 1, masks.shape[0])]
        assert resident[layer] == expected
        total_switches += int((masks[p:] != masks[p - 1 : -1]).any(-1).sum())
    assert total_switches > 0
    assert switches == total_switches  # the runtime's count of ω changes is the metric's
    assert loads >= total_switches  # each switch loads at least the activated expert outside the option


def test_lru_hit_rate_matches_hand_computation():
    model = moectl.tiny("olmoe")
    layer = moectl.inspect(model).layers[0]
    reference = copy.deepcopy(layer.block.experts)
    steps = [[0, 1], [1, 2], [0, 1], [3, 4], [4, 3], [1, 3]]
    # budget 2, experts visited in ascending id order within a step; a miss evicts the least
    # recently used expert the step does not need (ResidentSet's victims):
    # s1 miss 0, miss 1 | s2 hit 1, miss 2 (evicts 0) | s3 miss 0 (evicts 2, not 1: needed), hit 1
    # s4 miss 3 (evicts 0), miss 4 (evicts 1) | s5 hit 3, hit 4 | s6 miss 1 (evicts 4), hit 3
    hits, misses = 5, 7
    gen = torch.Generator().manual_seed(0)
    with offload(model, 2, "lru", store="disk") as rt:
        experts, res = rt.modules[0], rt.modules[0].res
        for step in steps:
            x = torch.randn(1, 64, generator=gen)
            idx = torch.tensor([step])
            w = torch.softmax(torch.randn(1, 2, generator=gen), -1)
            assert torch.equal(experts(x, idx, w), reference(x, idx, w))
            assert len(res.where) <= 2
        assert (res.hits, res.misses, res.loads) == (hits, misses, misses)
        assert res.hits / (res.hits + res.misses) == pytest.approx(5 / 12)
        expert_bytes = (192 * 64 + 64 * 96) * 4  # gate_up_proj [192, 64] + down_proj [64, 96], float32
        assert res.expert_bytes == expert_bytes
        assert res.bytes_moved == res.loads * expert_bytes
        assert res.slot_bytes == 2 * expert_bytes
        assert res.resident == [1, 3]


def test_budget_smaller_than_top_k_is_refused():
    model = moectl.tiny("olmoe")  # 8 experts, top-k 2
    with pytest.raises(BudgetError, match=r"budget of 1 resident experts is too small.*top-k = 2"):
        offload(model, 1, "lru").__enter__()
    with pytest.raises(BudgetError, match="too small"):
        offload(model, 0.2, "lru").__enter__()  # 0.2 x 8 = 1 expert
    with pytest.raises(BudgetError, match="needs at least 4"):
        offload(model, 3, "option:4").__enter__()
    with pytest.raises(ValueError, match="k-hat = 1 is smaller than top-k = 2"):
        offload(model, 4, "option:1").__enter__()
    assert all(isinstance(p, torch.nn.Parameter) for p in model.parameters())  # nothing was touched
    assert "gate_up_proj" in dict(moectl.inspect(model).layers[0].block.experts.named_parameters())


def test_offloading_frees_expert_parameters():
    model = moectl.tiny("gpt_oss")
    nbytes = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    full = nbytes(model)
    experts = sum(
        p.numel() * p.element_size()
        for layer in moectl.inspect(model).layers
        for p in layer.block.experts.parameters()
    )
    with offload(model, 0.25, "lru", store="disk") as rt:
        assert nbytes(model) == full - experts
        assert rt.totals()["resident_expert_bytes"] == experts // 4
    assert nbytes(model) == full


def test_static_policy_equals_masked_in_memory_model():
    model = moectl.tiny("qwen2_moe")
    info = moectl.inspect(model)
    subsets = {0: [1, 4, 6], 1: [0, 2, 5], 2: [3, 4, 7]}
    ids = prompt(2)
    with moectl.route(model, [moectl.ExpertMask.from_lists(info, subsets, renorm="pruned")]):
        reference = greedy(model, ids)
    from moectl.offload.residency import StaticPolicy

    with offload(model, 3, StaticPolicy(subsets), store="disk") as rt:
        with moectl.route(model, rt.policy.routing(rt.info)):
            out = greedy(model, ids)
        assert [r.resident for r in rt.resident_sets] == [subsets[i] for i in range(3)]
        assert rt.totals()["loads"] == 9  # each subset expert loaded once, never again
    assert torch.equal(out, reference)
    assert not torch.equal(out, greedy(model, ids))  # the subset really changes routing


def test_a_routing_beside_the_residency_policy_serves_as_the_resident_model_routed_so(tmp_path):
    """``serve-offload --routing topk:1``: every prompt routed to one expert per token (fewer loads),
    its text the resident model's under the same routing; a bad routing is one line, exit 2."""
    import json

    from typer.testing import CliRunner

    from moectl.cli import app
    from moectl.engine import Engine, SamplingParams
    from moectl.offload.offload_config import OffloadConfig
    from moectl.server.offload_batch import serve_offload

    model, tok, _ = moectl.load("tiny:olmoe", dtype="float32")
    prompts = ["The mixture of experts", "Once upon a time"]
    config = OffloadConfig(budget=4, policy="lru", store="host")
    plain = serve_offload(copy.deepcopy(model), tok, prompts, config, 6, progress=False)
    one = serve_offload(copy.deepcopy(model), tok, prompts, config, 6, progress=False, routing="topk:1")
    with Engine(model, tok, routings={"one": "topk:1"}) as engine:
        resident = engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True), routing="one")
    assert one["texts"] == [c.text for c in resident]
    assert one["routing"] == "topk:1" and plain["routing"] is None
    assert one["loads_per_token"] < plain["loads_per_token"]
    out = tmp_path / "r.json"
    ran = CliRunner().invoke(app, ["serve-offload", "--tiny", "olmoe", "--routing", "topk:1", "--max-new-tokens", "2",
                                   "--json", str(out)])  # fmt: skip
    assert ran.exit_code == 0, ran.output
    assert json.loads(out.read_text())["routing"] == "topk:1"
    bad = CliRunner().invoke(app, ["serve-offload", "--tiny", "olmoe", "--routing", "topk:0", "--max-new-tokens", "2"])
    assert bad.exit_code == 2 and "topk needs an integer n >= 1" in bad.output
