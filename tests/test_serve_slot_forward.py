"""The slot-grouped experts forward (offload/slot_forward.py) equals transformers' eager loop over the
same slots: same tokens, logits within float32 rounding, identical residency traffic."""

from __future__ import annotations

import pytest
import torch

import moectl
from _serve_helpers import greedy, prompt
from moectl.offload import OffloadConfig, offload

torch.set_num_threads(1)


def _run(model, forward: str, policy: str, budget: int, ids: torch.Tensor):
    config = OffloadConfig(budget=budget, policy=policy, store="host", experts_forward=forward)
    with offload(model, config) as rt:
        grouped = [m.grouped for m in rt.modules]
        tokens = greedy(model, ids)
        logits = model(tokens).logits
        stats = [(m.res.hits, m.res.misses, m.res.loads, list(m.res.events), m.switches) for m in rt.modules]
    return grouped, tokens, logits, stats


@pytest.mark.parametrize(
    ("family", "policy", "budget"),
    [("qwen2_moe", "lru", 2), ("olmoe", "lru", 3), ("olmoe", "option:3", 3), ("mixtral", "lru", 8)],
)
def test_grouped_equals_eager(family, policy, budget):
    model = moectl.tiny(family)
    ids = prompt(1)
    used, tokens, logits, stats = _run(model, "grouped", policy, budget, ids)
    eager_used, eager_tokens, eager_logits, eager_stats = _run(model, "eager", policy, budget, ids)
    assert all(used) and not any(eager_used)
    assert torch.equal(tokens, eager_tokens)
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
    assert stats == eager_stats  # hits, misses, loads, load events and switches: the same traffic


def test_layouts_it_cannot_compute_keep_the_eager_loop():
    model = moectl.tiny("gpt_oss")  # biases and a transposed layout
    with offload(model, OffloadConfig(budget=2, store="host")) as rt:
        assert not any(m.grouped for m in rt.modules)
        greedy(model, prompt(), n=2)


def test_a_forward_wider_than_the_budget_falls_back_to_the_loop():
    """A 24-token prefill touches more than 2 of 8 experts: the eager loop computes it while they
    rotate through the slots; the decode steps (2 experts each) run grouped."""
    model = moectl.tiny("qwen2_moe")
    ids = prompt(2, length=24)
    reference = greedy(model, ids)
    calls = {"grouped": 0, "eager": 0}
    with offload(model, OffloadConfig(budget=2, store="host")) as rt:
        for m in rt.modules:
            inner_forward = m.inner.forward

            def counted(*args, _f=inner_forward, **kwargs):
                calls["eager"] += 1
                return _f(*args, **kwargs)

            m.inner.forward = counted
            grouped = m._grouped

            def counted_grouped(*args, _g=grouped):
                out = _g(*args)
                calls["grouped"] += out is not None
                return out

            m._grouped = counted_grouped
        assert torch.equal(greedy(model, ids), reference)
    layers = len(moectl.inspect(model).layers)
    assert calls["eager"] >= layers  # the prefill, in every layer
    assert calls["grouped"] >= layers * 5  # most of the 9 decode steps in every layer


def test_unknown_experts_forward_refused():
    with pytest.raises(ValueError, match="experts forward must be one of grouped, eager"):
        OffloadConfig(experts_forward="fast")


def test_bf16_slots_pad_long_prompts_and_compute_the_same(monkeypatch):
    """bf16 slots on the CPU: a long prompt's groups are padded (``cpu_pad``), decoding's are not;
    the padded forward equals the unpadded one."""
    import moectl.offload.slot_forward as slot_forward

    model = moectl.tiny("olmoe")
    experts = next(m for m in model.modules() if hasattr(m, "gate_up_proj"))
    g = torch.Generator().manual_seed(0)
    slots = {n: getattr(experts, n).detach()[:4].to(torch.bfloat16) for n in ("gate_up_proj", "down_proj")}
    hidden = torch.randn(400, experts.gate_up_proj.shape[-1], generator=g).to(torch.bfloat16)
    index = torch.randint(0, 4, (400, 2), generator=g)
    weights = torch.rand(400, 2, generator=g)
    pads = []
    real = slot_forward.cpu_pad
    monkeypatch.setattr(slot_forward, "cpu_pad", lambda *a: pads.append(real(*a)) or pads[-1])
    padded = slot_forward.slot_experts_forward(experts, slots, hidden, index, weights)
    slot_forward.slot_experts_forward(experts, slots, hidden[:1], index[:1], weights[:1])
    assert pads == [32, 1]  # the prompt padded, the decoding step not
    monkeypatch.setattr(slot_forward, "cpu_pad", lambda *a: 1)
    torch.testing.assert_close(padded, slot_forward.slot_experts_forward(experts, slots, hidden, index, weights))
