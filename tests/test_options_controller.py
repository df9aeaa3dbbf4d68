"""TE-MoE controllers: shapes and masks, Plackett–Luce, GAE, termination-gradient sign, persistence."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import moectl
from moectl.options.controller import OptionController, build_controller, controller_sizes
from moectl.options.plackett_luce import mask_of, pl_log_prob, pl_sample
from moectl.options.policy import ControllerPolicy
from moectl.options.returns import discounted_cumsum, gae, monte_carlo_returns, rms_normalise, standardise
from moectl.routing.kv_cache import cache_out, with_cache


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_option_has_k_hat_experts_and_topk_stays_inside(family):
    model = moectl.tiny(family)
    info = moectl.inspect(model)
    k_hat = info.top_k + 1
    policy = ControllerPolicy(build_controller(info, k_hat), record=True)
    ids = torch.randint(3, 200, (3, 24))
    attn = torch.ones_like(ids)
    attn[1, :5] = 0  # left padding
    with moectl.route(model, policy, record=True) as session:
        model(input_ids=ids, attention_mask=attn)
    trace = session.trace
    for layer, allowed in trace.allowed.items():
        real = trace.valid
        assert bool((allowed.sum(-1)[real] == k_hat).all())
        chosen = trace.chosen[layer].long()
        assert bool(allowed.gather(-1, chosen)[real].all()), "a routed expert lies outside the option"
    rec = policy.layer_records()[0]
    assert rec.start[1, 5] and not rec.start[1, :5].any() and rec.start[0, 0]
    assert not bool((rec.switch & rec.start).any()), "no switch is sampled at t = 0"


def test_first_option_is_router_top_k_hat():
    model = moectl.tiny("olmoe")
    info = moectl.inspect(model)
    policy = ControllerPolicy(build_controller(info, 4), record=True)
    with moectl.route(model, policy, record=True) as session:
        model(torch.randint(3, 200, (2, 6)))
    probs = session.trace.probs[0][:, 0]
    expected = mask_of(probs.topk(4, dim=-1).indices, info.num_experts)
    assert torch.equal(session.trace.allowed[0][:, 0], expected)


def test_decoding_carries_the_option_across_calls():
    """Prefill + decode in steps gives the same masks as one call over the whole sequence (greedy)."""
    model = moectl.tiny("qwen2_moe")
    info = moectl.inspect(model)
    ctrl = build_controller(info, 4)
    with torch.no_grad():
        for layer in ctrl.layers:
            layer.termination[-1].bias.fill_(0.0)  # β near 1/2: greedy switches happen
    ids = torch.randint(3, 200, (2, 12))
    whole = ControllerPolicy(ctrl, mode="greedy", record=True)
    with moectl.route(model, whole):
        model(ids)
    stepwise = ControllerPolicy(ctrl, mode="greedy", record=True)
    with moectl.route(model, stepwise):
        out = model(ids[:, :8], use_cache=True)
        cache = cache_out(out)
        for t in range(8, 12):
            out = model(ids[:, t : t + 1], **with_cache(cache), use_cache=True)
            cache = cache_out(out)
    for layer in range(info.num_moe_layers):
        a, b = whole.layer_records()[layer], stepwise.layer_records()[layer]
        assert torch.equal(a.option, b.option) and torch.equal(a.switch, b.switch)
        assert torch.allclose(a.beta, b.beta, atol=1e-5)


def test_plackett_luce_log_prob_matches_brute_force():
    torch.manual_seed(0)
    c = torch.randn(5)
    for order in itertools.permutations(range(5), 3):
        p = 1.0
        remaining = list(range(5))
        for i in order:
            p *= math.exp(c[i]) / sum(math.exp(c[m]) for m in remaining)
            remaining.remove(i)
        got = pl_log_prob(c, torch.tensor(order))
        assert abs(float(got) - math.log(p)) < 1e-5
    total = sum(float(pl_log_prob(c, torch.tensor(o)).exp()) for o in itertools.permutations(range(5), 3))
    assert abs(total - 1.0) < 1e-5


def test_plackett_luce_sampling_frequencies():
    c = torch.tensor([2.0, 1.0, 0.0, -1.0])
    gen = torch.Generator().manual_seed(0)
    samples = pl_sample(c.expand(20000, 4), 2, gen)
    firsts = torch.bincount(samples[:, 0], minlength=4).float() / 20000
    assert torch.allclose(firsts, c.softmax(0), atol=0.015)
    pair = ((samples[:, 0] == 0) & (samples[:, 1] == 1)).float().mean()
    assert abs(float(pair) - float(pl_log_prob(c, torch.tensor([0, 1])).exp())) < 0.015


def test_gae_and_returns_match_hand_computation():
    r = torch.tensor([[1.0, 2.0, 3.0]])
    valid = torch.ones(1, 3)
    g = 0.9
    assert torch.allclose(
        monte_carlo_returns(r, valid, g), torch.tensor([[1 + 0.9 * 2 + 0.81 * 3, 2 + 0.9 * 3, 3.0]])
    )
    delta = torch.tensor([[0.5, -1.0, 2.0]])
    gl = 0.95 * 0.9
    hand = torch.tensor([[0.5 + gl * -1.0 + gl**2 * 2.0, -1.0 + gl * 2.0, 2.0]])
    assert torch.allclose(gae(delta, valid, 0.95, 0.9), hand)
    # a sequence that ends after two steps: the third step contributes nothing
    short = torch.tensor([[1.0, 1.0, 0.0]])
    assert torch.allclose(gae(delta, short, 0.95, 0.9), torch.tensor([[0.5 + gl * -1.0, -1.0, 0.0]]))
    assert torch.allclose(discounted_cumsum(torch.ones(1, 4), 0.5), torch.tensor([[1.875, 1.75, 1.5, 1.0]]))


def test_advantage_normalisation():
    a = torch.tensor([3.0, -4.0, 100.0])
    where = torch.tensor([True, True, False])
    out = rms_normalise(a, where)
    assert torch.allclose(out[:2], torch.tensor([3.0, -4.0]) / math.sqrt(12.5))
    s = standardise(torch.tensor([[1.0, 2.0, 3.0, 50.0]]), torch.tensor([[True, True, True, False]]))
    assert torch.allclose(s[0, :3].mean(), torch.tensor(0.0), atol=1e-6) and s[0, 3] == 0


def test_termination_gradient_pushes_beta_down_when_advantage_positive():
    """One step on the controller loss lowers β where Q − V + η > 0 and raises it where < 0 (eq. 9)."""
    from moectl.lm.padding import left_pad
    from moectl.options.option_losses import controller_loss
    from moectl.options.rollout import rollout

    model = moectl.tiny("olmoe")
    info = moectl.inspect(model)
    base = build_controller(info, 4)
    ids, attn = left_pad([[5, 6, 7, 8, 9], [10, 11, 12]], 0)
    roll = rollout(
        model, info, ControllerPolicy(base), ids, attn, 8, generator=torch.Generator().manual_seed(0)
    )

    def mean_beta(ctrl):
        with torch.no_grad():
            rec = roll.records[0]
            return (
                ctrl.layers[0]
                .beta(rec.hidden, ctrl.layers[0].set_embedding(rec.prev))[:, roll.prompt_len :]
                .mean()
            )

    for eta, lower in ((50.0, True), (-50.0, False)):
        ctrl = build_controller(info, 4)
        ctrl.load_state_dict(base.state_dict())
        before = mean_beta(ctrl)
        loss, _ = controller_loss(ctrl, roll, eta=eta, value_coef=0.0)
        loss.backward()
        torch.optim.SGD(ctrl.parameters(), lr=0.1).step()
        after = mean_beta(ctrl)
        assert (after < before) if lower else (after > before), (eta, float(before), float(after))


def test_controller_init_and_sizes(tmp_path):
    model = moectl.tiny("olmoe")
    info = moectl.inspect(model)
    ctrl = build_controller(info, 4)
    router = info.layers[0].router.weight
    assert torch.allclose(ctrl.layers[0].selection.weight, router.float())
    beta = ctrl.layers[0].termination[-1].bias
    assert float(beta) == -3.0
    assert controller_sizes(2880) == (128, 1024) and controller_sizes(64)[1] == 32
    ctrl.save(tmp_path / "c")
    again = OptionController.load(tmp_path / "c")
    for (k, a), (_, b) in zip(ctrl.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    with pytest.raises(ValueError, match="k-hat must be between"):
        build_controller(info, 1)
    with pytest.raises(ValueError, match="controller was built for"):
        again.check(moectl.inspect(moectl.tiny("mixtral", hidden_size=32)))


def test_cross_layer_option_switches_every_layer_together():
    model = moectl.tiny("qwen2_moe")
    info = moectl.inspect(model)
    ctrl = build_controller(info, 4, cross_layer=True)
    with torch.no_grad():
        for layer in ctrl.layers:
            layer.termination[-1].bias.fill_(-0.5)  # frequent switches
    policy = ControllerPolicy(ctrl, record=True)
    with moectl.route(model, policy):
        model(torch.randint(3, 200, (2, 40)))
    records = policy.layer_records()
    assert records[0].switch.any()
    for rec in records.values():
        assert torch.equal(rec.switch, records[0].switch)


def test_eta_from_measured_latency():
    from moectl.options.latency import expert_tensors, measure_switch_cost

    model = moectl.tiny("olmoe")
    info = moectl.inspect(model)
    tensors = expert_tensors(info)
    assert tensors and all(t.shape[0] != info.num_experts for t in tensors)
    cost = measure_switch_cost(model, info, k_hat=4, nats_per_token_delay=0.5, repeats=2)
    assert cost["load_s"] > 0 and cost["token_s"] > 0 and cost["expert_bytes"] > 0
    assert cost["eta"] == pytest.approx(0.5 * 4 * cost["load_s"] / cost["token_s"])
