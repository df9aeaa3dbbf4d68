"""A deliberation cost in experts (bytes) brought in (issue 44 item 2): η_t = eta_per_expert × n_new_t."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from typer.testing import CliRunner

import moectl
from moectl.cli import app
from moectl.errors import ConfigError
from moectl.models.load import load_model
from moectl.options.controller import build_controller
from moectl.options.option_losses import (
    controller_loss,
    experts_brought_in,
    layer_heads,
    switch_cost_stats,
    switch_costs,
    termination_loss,
)
from moectl.options.plackett_luce import mask_of
from moectl.options.policy import OptionRecord
from moectl.options.rollout import Rollout
from moectl.options.train_run import OptionsRunConfig
from moectl.options.trainer import OptionsConfig, OptionsTrainer, check_resume, train_options

PROMPTS = ["hello world", "the cat sat on the", "def f(x):", "1 + 2 =", "Once upon a time"]
N, K_HAT, P, S = 8, 4, 2, 3  # tiny:olmoe's 8 experts, options of 4; 2 prompt tokens, 3 generated
runner = CliRunner()


def _set(*experts: int) -> list[bool]:
    return [e in experts for e in range(N)]


# ω_{t−1} and the tuple the selection head drew, at the generated steps t = 0, 1, 2 of two rows
PREV = [
    [_set(0, 1, 2, 3), _set(0, 1, 2, 3), _set(2, 3, 4, 5)],
    [_set(4, 5, 6, 7), _set(0, 1, 2, 7), _set(0, 1, 2, 7)],
]
ORDER = [[[0, 1, 2, 3], [3, 2, 5, 4], [0, 1, 6, 7]], [[7, 0, 1, 2], [1, 0, 2, 7], [4, 5, 6, 3]]]
N_NEW = [[0, 2, 4], [3, 0, 4]]  # |drawn ∖ ω_{t−1}|
SWITCH = [[False, True, True], [True, False, False]]  # d_t
VALID = [[True, True, True], [True, True, False]]  # row 1 ended after two tokens


def _rollout(prev: list, order: list, hidden_size: int, seed: int = 0) -> Rollout:
    """A hand-made rollout of one MoE layer: records at positions 0 .. P + S − 2 (the prompt's first
    token starts the option; the generated steps' decisions are at P − 1 .. P + S − 2)."""
    g = torch.Generator().manual_seed(seed)
    b, t = len(prev), P + S - 1
    start_prev = torch.tensor([_set(0, 1, 2, 3)] * b)[:, None]
    prev_t = torch.cat([start_prev, torch.tensor(prev)], 1)
    order_t = torch.cat([torch.tensor([[[0, 1, 2, 3]]] * b), torch.tensor(order)], 1)
    switch = torch.cat([torch.zeros(b, 1, dtype=torch.bool), torch.tensor(SWITCH)], 1)
    option = torch.where(switch[..., None], mask_of(order_t, N), prev_t)
    start = torch.zeros(b, t, dtype=torch.bool)
    start[:, 0] = True
    record = OptionRecord(
        hidden=torch.randn(b, t, hidden_size, generator=g),
        prev=prev_t,
        option=option,
        order=order_t,
        switch=switch,
        start=start,
        beta=torch.rand(b, t, generator=g),
    )
    valid = torch.tensor(VALID)
    rewards = torch.randn(b, S, generator=g) * valid
    return Rollout(
        input_ids=torch.randint(3, 100, (b, P + S), generator=g),
        attention=torch.ones(b, P + S, dtype=torch.long),
        prompt_len=P,
        actions=torch.randint(3, 100, (b, S), generator=g),
        valid=valid,
        rewards=rewards,
        weights=(0.5 + torch.rand(b, S, generator=g)) * valid,
        logp_student=-torch.rand(b, S, generator=g),
        logp_teacher=-torch.rand(b, S, generator=g),
        records={0: record},
    )


@pytest.fixture(scope="module")
def controller():
    info = moectl.inspect(moectl.tiny("olmoe"))
    return build_controller(info, K_HAT, seed=0)


def test_n_new_counts_the_experts_the_drawn_option_brings_in(controller):
    roll = _rollout(PREV, ORDER, controller.config.hidden_size)
    prev, order = torch.tensor(PREV), torch.tensor(ORDER)
    assert experts_brought_in(prev, order).tolist() == N_NEW
    assert torch.equal(experts_brought_in(prev, order), (mask_of(order, N) & ~prev).sum(-1).float())
    heads = layer_heads(controller.layers[0], roll.records[0], roll)
    assert heads.n_new.tolist() == [[0, 2, 4], [3, 0, 0]]  # after the end of a row: no step, no cost
    # η_t charged: 0.5 per expert over the 5 decided steps; experts per switch: (2 + 4 + 3) / 3
    stats = switch_cost_stats([heads], switch_costs([heads], 0.02, 0.5), [True])
    assert stats == {"eta_mean": pytest.approx(0.5 * 9 / 5), "n_new_mean": pytest.approx(3.0)}
    assert switch_cost_stats([heads], switch_costs([heads], 0.02), [True])["eta_mean"] == pytest.approx(0.02)


def test_cost_per_expert_is_the_constant_eta_when_every_switch_brings_in_k_hat(controller):
    disjoint_prev = [[_set(0, 1, 2, 3)] * S, [_set(4, 5, 6, 7)] * S]
    disjoint_order = [[[4, 5, 6, 7]] * S, [[3, 2, 1, 0]] * S]
    roll = _rollout(disjoint_prev, disjoint_order, controller.config.hidden_size)
    heads = layer_heads(controller.layers[0], roll.records[0], roll)
    assert heads.n_new.tolist() == [[K_HAT] * S, [K_HAT, K_HAT, 0]]
    eta, per_expert = 0.5, 0.125  # per_expert × k̂ == eta, exactly in binary
    [eta_t] = switch_costs([heads], eta, per_expert)
    assert torch.equal(termination_loss(heads, roll, eta_t), termination_loss(heads, roll, eta))
    constant, _ = controller_loss(controller, roll, eta)
    per_switch, stats = controller_loss(controller, roll, 0.0, eta_per_expert=per_expert)  # eta ignored
    assert torch.equal(constant, per_switch) and stats["eta_mean"] == pytest.approx(eta)
    # the hand-made rollout, where switches bring in 0 to 4 experts, is charged otherwise
    roll = _rollout(PREV, ORDER, controller.config.hidden_size)
    assert not torch.equal(
        controller_loss(controller, roll, eta)[0],
        controller_loss(controller, roll, 0.0, eta_per_expert=per_expert)[0],
    )


def test_one_cross_layer_decision_is_charged_every_layer_s_experts(controller):
    roll = _rollout(PREV, ORDER, controller.config.hidden_size)
    heads = layer_heads(controller.layers[0], roll.records[0], roll)
    other = dataclasses.replace(heads, n_new=torch.full_like(heads.n_new, 1.0) * heads.steps)
    alone = switch_costs([heads, other], 0.02, 0.5)
    assert torch.equal(alone[0], 0.5 * heads.n_new) and torch.equal(alone[1], 0.5 * other.n_new)
    shared = switch_costs([heads, other], 0.02, 0.5, cross_layer=True)
    assert torch.equal(shared[0], 0.5 * (heads.n_new + other.n_new))
    assert switch_costs([heads, other], 0.02, None, cross_layer=True) == [0.02, 0.02]


def test_the_config_keeps_the_cost_per_expert_and_old_configs_load(tmp_path):
    config = OptionsConfig(k_hat=4, eta_per_expert=0.01)
    assert OptionsConfig.load(config.save(tmp_path / "options.json")) == config
    assert config.cost_label() == "eta=0.01/expert" and OptionsConfig(k_hat=4).cost_label() == "eta=0.02"
    old = OptionsConfig(k_hat=4).to_dict()
    del old["eta_per_expert"]  # options.json of a run before the field existed
    assert OptionsConfig.from_dict(old).eta_per_expert is None
    with pytest.raises(ConfigError, match=r"eta_per_expert=-1\.0"):
        OptionsConfig(k_hat=4, eta_per_expert=-1.0)
    with pytest.raises(ConfigError, match="must be a number or null"):
        OptionsConfig.from_dict({"k_hat": 4, "eta_per_expert": "0.1"})
    run = OptionsRunConfig("tiny:olmoe", tmp_path / "r", OptionsConfig(k_hat=4), eta_bytes_from_latency=2.0)
    assert OptionsRunConfig.load(run.save(tmp_path / "run.json")) == run
    with pytest.raises(ConfigError, match="each set the deliberation cost"):
        OptionsRunConfig("tiny:olmoe", tmp_path / "r", config, eta_bytes_from_latency=2.0)
    # a checkpoint written before the field existed resumes under a config without a cost per expert
    model, tok = load_model("tiny:olmoe")
    plain = OptionsConfig(k_hat=4, steps=1, batch_size=2, max_new_tokens=4, intra=False)
    trainer = OptionsTrainer(model, tok, PROMPTS, plain, tmp_path / "old")
    trainer.train_step()
    saved = trainer.save() / "options.json"
    settings = json.loads(saved.read_text())
    del settings["eta_per_expert"]
    saved.write_text(json.dumps(settings))
    assert check_resume(tmp_path / "old", plain) is not None
    with pytest.raises(ConfigError, match=r"eta_per_expert None → 0\.01"):
        check_resume(tmp_path / "old", plain.with_(eta_per_expert=0.01))


@pytest.mark.parametrize(
    "flags",
    [
        ["--eta", "0.1", "--eta-per-expert", "0.01"],
        ["--eta", "0.1", "--eta-bytes-from-latency", "1"],
        ["--eta-per-expert", "0.01", "--eta-bytes-from-latency", "1"],
        ["--eta-from-latency", "1", "--eta-per-expert", "0.01"],
        ["--eta-per-expert", "-1"],
        ["--eta-bytes-from-latency", "-1"],
    ],
)
def test_cli_refuses_two_deliberation_costs_in_one_line(tmp_path, flags):
    out = tmp_path / "ctl"
    result = runner.invoke(app, ["options", "train", "tiny:olmoe", "--k-hat", "4", "--out", str(out), *flags])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "eta" in lines[0], result.output
    assert not out.exists()  # refused before any work


def test_training_with_a_cost_per_expert_logs_it_and_resumes_exactly(tmp_path):
    cfg = OptionsConfig(
        k_hat=4,
        eta_per_expert=0.05,
        steps=3,
        batch_size=3,
        max_new_tokens=6,
        save_every=1,
        lora_r=4,
        lora_alpha=4,
    )
    model, tok = load_model("tiny:qwen2_moe")
    train_options(model, tok, PROMPTS, cfg, tmp_path / "a", progress=False)
    model, tok = load_model("tiny:qwen2_moe")
    train_options(model, tok, PROMPTS, cfg, tmp_path / "b", progress=False, stop_after=2)
    model, tok = load_model("tiny:qwen2_moe")
    assert train_options(model, tok, PROMPTS, cfg, tmp_path / "b", progress=False)["resumed"]
    a, b = ([json.loads(x) for x in (tmp_path / run / "log.jsonl").read_text().splitlines()] for run in "ab")
    assert [r["step"] for r in b] == [1, 2, 3]
    for key in ("controller_loss", "intra_loss", "reward", "switch_rate", "eta_mean", "n_new_mean"):
        assert a[2][key] == b[2][key], key
    assert all(0 < r["eta_mean"] <= 0.05 * 4 and 0 <= r["n_new_mean"] <= 4 for r in a)
    assert json.loads((tmp_path / "a" / "final" / "options.json").read_text())["eta_per_expert"] == 0.05
    with pytest.raises(ConfigError, match=r"eta_per_expert 0\.05 → 0\.1"):
        check_resume(tmp_path / "b", cfg.with_(eta_per_expert=0.1))


def test_cli_trains_with_a_cost_per_expert_given_or_measured(tmp_path):
    common = ["options", "train", "tiny:olmoe", "--k-hat", "4", "--batch-size", "2", "--max-new-tokens", "6"]
    out = tmp_path / "given"
    result = runner.invoke(
        app,
        [
            *common,
            "--steps",
            "2",
            "--eta-per-expert",
            "0.05",
            "--out",
            str(out),
            "--json",
            str(tmp_path / "g.json"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "η=0.0500 per expert brought in" in result.output
    report = json.loads((tmp_path / "g.json").read_text())
    assert report["config"]["eta_per_expert"] == 0.05 and report["latency"] is None
    assert all({"eta_mean", "n_new_mean"} <= set(row) for row in report["log"])
    again = runner.invoke(app, [*common, "--steps", "3", "--eta-per-expert", "0.05", "--out", str(out)])
    assert again.exit_code == 0, again.output  # the same command resumes (--steps may grow)
    log = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3] and log[:2] == report["log"]

    result = runner.invoke(
        app,
        [*common, "--steps", "1", "--eta-bytes-from-latency", "2", "--out", str(tmp_path / "measured"),
         "--json", str(tmp_path / "m.json")],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "per expert brought in" in result.output and "η from latency: one expert" in result.output
    report = json.loads((tmp_path / "m.json").read_text())
    latency = report["latency"]
    assert latency["eta_per_expert"] == pytest.approx(2 * latency["load_s"] / latency["token_s"])
    assert latency["eta_per_byte"] == pytest.approx(latency["eta_per_expert"] / latency["expert_bytes"])
    assert report["config"]["eta_per_expert"] == latency["eta_per_expert"] and "eta" not in latency
