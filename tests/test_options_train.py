"""TE-MoE options training: rollouts, losses, a short run, exact resume, the CLI."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import moectl
from moectl.cli import app
from moectl.lm.padding import left_pad
from moectl.models.load import load_model
from moectl.options.controller import build_controller
from moectl.options.option_losses import student_log_probs
from moectl.options.policy import ControllerPolicy
from moectl.options.rollout import rollout
from moectl.options.teacher import add_lora, teacher_mode
from moectl.options.trainer import OptionsConfig, OptionsTrainer, train_options
from moectl.train.master_weights import MasterWeights

PROMPTS = [
    "hello world",
    "the cat sat on the",
    "def f(x):",
    "1 + 2 =",
    "Once upon a time",
    "Il était une fois",
]
runner = CliRunner()


def test_rollout_rewards_weights_and_recomputed_log_probs():
    model = moectl.tiny("qwen2_moe")
    info = moectl.inspect(model)
    model, snapshot = add_lora(model, info, r=4, alpha=4)
    info = moectl.inspect(model)
    ids, attn = left_pad([[5, 6, 7, 8], [9, 10]], 0)
    roll = rollout(
        model,
        info,
        ControllerPolicy(build_controller(info, 4)),
        ids,
        attn,
        10,
        tau=0.2,
        generator=torch.Generator().manual_seed(0),
        router_snapshot=snapshot,
    )
    assert roll.actions.shape == (2, 10) and bool(roll.valid.all())
    assert torch.allclose(roll.rewards, roll.logp_teacher - roll.logp_student)
    assert bool((roll.weights > 0).all()) and bool((roll.weights < 1 / 0.8 + 1e-4).all())  # w ≤ 1/(1−τ)
    # the full forward under the recorded options reproduces the rollout's student log-probs
    assert torch.allclose(student_log_probs(model, info, roll), roll.logp_student, atol=1e-4)
    assert all(rec.option.shape[1] == ids.shape[1] + 9 for rec in roll.records.values())


def test_teacher_mode_is_the_original_model():
    model = moectl.tiny("olmoe")
    info = moectl.inspect(model)
    ids = torch.randint(3, 200, (2, 8))
    with torch.no_grad():
        original = model(ids).logits
    peft_model, snapshot = add_lora(model, info, r=4, alpha=4)
    info = moectl.inspect(peft_model)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.add_(0.1)
        info.layers[0].router.weight.add_(0.5)
        changed = peft_model(input_ids=ids).logits
        with teacher_mode(peft_model, info, snapshot):
            teacher = peft_model(input_ids=ids).logits
        after = peft_model(input_ids=ids).logits
    assert not torch.allclose(changed, original, atol=1e-3)
    assert torch.allclose(teacher, original, atol=1e-5)
    assert torch.allclose(after, changed)  # the trained routers are back after the teacher's forward


def _mean_beta(trainer: OptionsTrainer, ids: torch.Tensor) -> float:
    policy = ControllerPolicy(trainer.controller, record=True)
    with torch.no_grad(), moectl.route(trainer.model, policy, info=trainer.info):
        trainer.model(input_ids=ids)
    return float(torch.stack([r.beta[:, 1:].mean() for r in policy.layer_records().values()]).mean())


def test_training_at_high_eta_lowers_the_switch_probability(tmp_path):
    model, tok = load_model("tiny:olmoe")
    cfg = OptionsConfig(
        k_hat=4, eta=2.0, steps=6, batch_size=4, max_new_tokens=12, lr_controller=3e-3, intra=False
    )
    trainer = OptionsTrainer(model, tok, PROMPTS, cfg, tmp_path)
    ids = torch.randint(3, 200, (4, 32), generator=torch.Generator().manual_seed(1))
    before = _mean_beta(trainer, ids)
    rows = [trainer.train_step() for _ in range(cfg.steps)]
    after = _mean_beta(trainer, ids)
    assert after < 0.5 * before, (before, after)
    assert rows[-1]["switch_prob_mean"] < rows[0]["switch_prob_mean"]
    keys = {
        "reward",
        "switch_rate",
        "switch_prob_p95",
        "switch_prob_std",
        "value_loss",
        "repetition_rate",
        "teacher_ppl",
    }
    assert keys <= set(rows[0])


def test_resume_reproduces_the_next_step_exactly(tmp_path):
    cfg = OptionsConfig(
        k_hat=4, eta=0.5, steps=3, batch_size=3, max_new_tokens=6, save_every=1, lora_r=4, lora_alpha=4
    )
    model, tok = load_model("tiny:qwen2_moe")
    train_options(model, tok, PROMPTS, cfg, tmp_path / "a", progress=False)
    model, tok = load_model("tiny:qwen2_moe")
    train_options(model, tok, PROMPTS, cfg, tmp_path / "b", progress=False, stop_after=2)
    model, tok = load_model("tiny:qwen2_moe")
    result = train_options(model, tok, PROMPTS, cfg, tmp_path / "b", progress=False)
    assert result["resumed"]
    a = [json.loads(x) for x in (tmp_path / "a" / "log.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in b] == [1, 2, 3]
    for key in ("controller_loss", "intra_loss", "reward", "switch_rate"):
        assert a[2][key] == b[2][key], key
    assert (tmp_path / "a" / "curves.png").stat().st_size > 0


def test_cli_train_generate_eval(tmp_path):
    out = tmp_path / "ctl"
    result = runner.invoke(
        app,
        [
            "options",
            "train",
            "tiny:olmoe",
            "--k-hat",
            "4",
            "--steps",
            "2",
            "--batch-size",
            "2",
            "--max-new-tokens",
            "6",
            "--out",
            str(out),
            "--json",
            str(tmp_path / "t.json"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert (out / "final" / "controller.json").exists() and json.loads((tmp_path / "t.json").read_text())[
        "log"
    ]
    result = runner.invoke(
        app,
        [
            "options",
            "generate",
            "tiny:olmoe",
            "--controller",
            str(out),
            "--prompt",
            "abc",
            "--max-new-tokens",
            "8",
            "--plot",
            str(tmp_path / "p"),
            "--json",
            str(tmp_path / "g.json"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "p" / "options_prompt0.png").exists()  # one figure per prompt, every layer
    assert 0.0 <= json.loads((tmp_path / "g.json").read_text())["switch_rate"] <= 1.0
    result = runner.invoke(
        app,
        [
            "options",
            "eval",
            "tiny:olmoe",
            "--controller",
            str(out),
            "--max-docs",
            "1",
            "--max-length",
            "32",
            "--max-new-tokens",
            "6",
            "--json",
            str(tmp_path / "e.json"),
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "e.json").read_text())
    assert report["quality"]["kl"] >= 0 and report["switching"]["source"] == "allowed"
    bad = runner.invoke(
        app, ["options", "train", "tiny:olmoe", "--k-hat", "99", "--steps", "1", "--out", str(tmp_path / "x")]
    )
    assert bad.exit_code == 2 and "k-hat must be between" in bad.output
    bad = runner.invoke(
        app, ["options", "train", "tiny:olmoe", "--k-hat", "4", "--tau", "2", "--out", str(tmp_path / "y")]
    )
    assert bad.exit_code == 2 and "tau=2.0" in bad.output


def test_the_trainer_step_is_the_controller_loss_of_its_rollout(tmp_path):
    """train_step spells out Algorithm 2's per-layer terms; their sum is losses.controller_loss's."""
    import copy

    from moectl.options.option_losses import controller_loss

    model, tok = load_model("tiny:olmoe")
    cfg = OptionsConfig(
        k_hat=4, eta=0.3, steps=1, batch_size=3, max_new_tokens=6, intra=False, cross_layer=True
    )
    trainer = OptionsTrainer(model, tok, PROMPTS, cfg, tmp_path)
    before = copy.deepcopy(trainer.controller)
    rolls = []
    roll_out = trainer.roll_out
    trainer.roll_out = lambda *args: rolls.append(roll_out(*args)) or rolls[-1]
    row = trainer.train_step()
    loss, stats = controller_loss(before, rolls[0], cfg.eta, cfg.gamma, cfg.lam, cfg.value_coef)
    assert row["controller_loss"] == float(loss)
    assert row["switch_rate_per_layer"] == stats["switch_rate_per_layer"]
    assert row["switch_prob_p95"] == stats["beta_p95"] and row["value_loss"] == stats["value_loss"]


def test_sigterm_checkpoints_the_finished_step_and_resume_continues(tmp_path, monkeypatch):
    """SIGTERM mid-run (between checkpoints): the finished step is saved, the run says how to resume,
    and the resumed run's log continues without a gap or a repeat."""
    import os
    import signal

    import pytest

    from moectl.stopping import TrainingInterrupted

    cfg = OptionsConfig(
        k_hat=4, eta=0.5, steps=4, batch_size=3, max_new_tokens=6, save_every=10, lora_r=4, lora_alpha=4
    )
    step = OptionsTrainer.train_step

    def step_then_sigterm(self):
        row = step(self)
        if self.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # as `kill PID` would, between two checkpoints
        return row

    monkeypatch.setattr(OptionsTrainer, "train_step", step_then_sigterm)
    model, tok = load_model("tiny:qwen2_moe")
    with pytest.raises(TrainingInterrupted, match="stopped after step 2; checkpoint saved"):
        train_options(model, tok, PROMPTS, cfg, tmp_path / "run", progress=False)
    assert (tmp_path / "run" / "checkpoints" / "step-000002").is_dir()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is gone after the run
    monkeypatch.setattr(OptionsTrainer, "train_step", step)
    model, tok = load_model("tiny:qwen2_moe")
    result = train_options(model, tok, PROMPTS, cfg, tmp_path / "run", progress=False)
    assert result["resumed"]
    log = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4]


def test_master_weights_step_float32_masters_of_bf16_parameters():
    g = torch.Generator().manual_seed(0)
    half = torch.nn.Parameter((0.1 * torch.randn(64, 32, generator=g)).bfloat16())
    full = torch.nn.Parameter(torch.randn(8, generator=g))
    masters = MasterWeights([half, full])
    opt_params = masters.optimizer_params()
    assert opt_params[0].dtype == torch.float32 and opt_params[1] is full
    opt = torch.optim.AdamW(opt_params, lr=1e-5)
    before = opt_params[0].detach().clone()
    half.grad, full.grad = torch.randn(half.shape, generator=g).bfloat16(), torch.randn(8, generator=g)
    masters.to_masters()
    assert half.grad is None and opt_params[0].grad.dtype == torch.float32
    opt.step()
    masters.to_model()
    assert (opt_params[0] != before).float().mean() > 0.99  # every entry moved by ≈ lr
    assert torch.equal(half, opt_params[0].bfloat16())
    state = masters.state_dict()
    other = MasterWeights([torch.nn.Parameter(half.detach().clone()), full])
    other.load_state_dict(state)
    assert torch.equal(other.optimizer_params()[0], opt_params[0])  # the float32 bits, not the rounding


def test_a_bf16_model_trains_its_routers_through_masters_and_resumes_exactly(tmp_path):
    cfg = OptionsConfig(
        k_hat=4, eta=0.5, steps=3, batch_size=3, max_new_tokens=6, save_every=1, lora_r=4, lora_alpha=4
    )
    model, tok = load_model("tiny:qwen2_moe", dtype="bfloat16")
    trainer = OptionsTrainer(model, tok, PROMPTS, cfg, tmp_path / "t")
    info = moectl.inspect(trainer.model)
    routers = [layer.router.weight for layer in info.layers]
    assert routers[0].requires_grad and routers[0].dtype == torch.bfloat16
    assert len(trainer.masters.masters) == len(routers)  # the routers, and no adapter, need a master
    start = [trainer.masters.masters[i].clone() for i in sorted(trainer.masters.masters)]
    trainer.train_step()
    for i, m0 in zip(sorted(trainer.masters.masters), start, strict=True):
        master = trainer.masters.masters[i]
        assert not torch.equal(master, m0)
        assert torch.equal(trainer.masters.params[i], master.to(torch.bfloat16))
    model, tok = load_model("tiny:qwen2_moe", dtype="bfloat16")
    train_options(model, tok, PROMPTS, cfg, tmp_path / "a", progress=False)
    model, tok = load_model("tiny:qwen2_moe", dtype="bfloat16")
    train_options(model, tok, PROMPTS, cfg, tmp_path / "b", progress=False, stop_after=2)
    model, tok = load_model("tiny:qwen2_moe", dtype="bfloat16")
    assert train_options(model, tok, PROMPTS, cfg, tmp_path / "b", progress=False)["resumed"]
    a = [json.loads(x) for x in (tmp_path / "a" / "log.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    for key in ("controller_loss", "intra_loss", "reward", "switch_rate"):
        assert a[2][key] == b[2][key], key
    # the step after the resume moved the float32 masters, not their bf16 rounding
    ra, rb = (load_file(str(tmp_path / run / "final" / "routers.safetensors")) for run in "ab")
    assert all(torch.equal(ra[k], rb[k]) for k in ra)
