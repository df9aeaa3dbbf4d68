"""The fast CPU training path: fused cross-entropy, grouped experts under autocast, the loss module,
log continuity across resumes, stop-and-checkpoint on a signal, and the allocator restart."""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest
import torch

from moectl.models.grouped_experts import grouped_experts_forward, register
from moectl.train.allocator import fast_allocator_env
from moectl.train.fused_ce import linear_cross_entropy
from moectl.train.loop import Trainer, TrainingInterrupted, pretrain, truncate_log
from moectl.train.model import build_model
from moectl.train.objective import NextTokenLoss
from moectl.train.speed import flops_per_token, kernel_kind, measure_training
from moectl.train.train_config import TrainConfig
from test_train import MICRO_MODEL

SPECIAL = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}


def _tiny_model(seed: int = 0):
    return build_model(TrainConfig.from_preset("tiny", out="x").model_kwargs(), 300, SPECIAL, seed)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_fused_cross_entropy_equals_the_reference_in_float64(chunk):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(50, 16, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(40, 16, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 40, (50,), generator=g)
    targets[[3, 17]] = -100
    loss = linear_cross_entropy(hidden, weight, targets, chunk=chunk)
    (2.5 * loss).backward()
    h2, w2 = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    ref = torch.nn.functional.cross_entropy(h2 @ w2.T, targets)
    (2.5 * ref).backward()
    # the log-softmax runs in float32 (as the training path does): float32 precision
    eps = torch.finfo(torch.float32).eps
    assert loss.item() == pytest.approx(ref.item(), rel=16 * eps)
    torch.testing.assert_close(hidden.grad, h2.grad, rtol=64 * eps, atol=64 * eps)
    torch.testing.assert_close(weight.grad, w2.grad, rtol=64 * eps, atol=64 * eps)


def test_fused_cross_entropy_refuses_bad_shapes():
    with pytest.raises(ValueError, match="targets has 3 rows"):
        linear_cross_entropy(torch.zeros(4, 2), torch.zeros(5, 2), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        linear_cross_entropy(torch.zeros(4, 2), torch.zeros(5, 2), torch.zeros(4, dtype=torch.long), chunk=0)


def test_grouped_experts_equal_the_eager_experts():
    model = _tiny_model().double()
    experts = model.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, model.config.hidden_size, dtype=torch.float64, generator=g)
    idx = torch.stack([torch.randperm(experts.num_experts, generator=g)[:2] for _ in range(37)])
    w = torch.rand(37, 2, dtype=torch.float64, generator=g)
    model.set_experts_implementation("eager")
    ref = experts(x, idx, w)
    got = grouped_experts_forward(experts, x, idx, w)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    assert register() == register() == "moectl_grouped"  # idempotent


def test_grouped_experts_run_in_the_autocast_dtype_and_grads_reach_fp32_weights():
    model = _tiny_model()
    experts = model.model.layers[0].mlp.experts
    x = torch.randn(9, model.config.hidden_size)
    idx = torch.randint(0, experts.num_experts, (9, 2))
    w = torch.rand(9, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = grouped_experts_forward(experts, x, idx, w)
    assert out.dtype == x.dtype
    out.sum().backward()
    assert experts.gate_up_proj.grad is not None and experts.gate_up_proj.grad.dtype == torch.float32


def test_next_token_loss_equals_transformers_loss():
    model = _tiny_model().double()
    model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    ids = torch.randint(3, 300, (2, 33))
    fused = NextTokenLoss(model)(ids)
    plain = NextTokenLoss(model, fused=False)(ids)
    assert fused.item() == pytest.approx(model(input_ids=ids, labels=ids).loss.item(), rel=1e-6)
    assert fused.item() == pytest.approx(plain.item(), rel=1e-6)


def test_flops_per_token_counts_active_parameters():
    model = _tiny_model()
    c = model.config
    fpt = flops_per_token(c, seq_len=256)
    # every matmul weight (2-D, not the embedding lookup) plus top-k of each layer's routed experts
    dense = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n)
    experts = model.model.layers[0].mlp.experts
    per_expert = experts.gate_up_proj[0].numel() + experts.down_proj[0].numel()
    active = dense + c.num_hidden_layers * c.num_experts_per_tok * per_expert
    active += c.hidden_size * c.vocab_size  # the tied LM head is a matmul
    attention = 12 * c.num_hidden_layers * 256 * c.num_attention_heads * c.head_dim
    assert fpt == pytest.approx(6 * active + attention, rel=1e-9)


def test_truncate_log_drops_steps_written_after_the_checkpoint(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"step": s, "ce": 1.0}) + "\n" for s in range(0, 60, 10)))
    truncate_log(log, 31)
    assert [json.loads(x)["step"] for x in log.read_text().splitlines()] == [0, 10, 20, 30]
    truncate_log(log, 0)
    assert not log.exists()


def _tiny_config(out, corpus, **kw):
    values = dict(
        out=str(out), corpus=str(corpus), seq_len=64, micro_batch=2, max_steps=6, warmup_steps=1,
        checkpoint_every=100, log_every=1, model=MICRO_MODEL, final_eval_batches=1,
    )  # fmt: skip
    return TrainConfig(**{**values, **kw})


def test_a_stop_request_checkpoints_the_last_step_and_resume_continues_the_log(tmp_path, corpus):
    config = _tiny_config(tmp_path / "run", corpus)
    trainer = Trainer(config, progress=False)
    original = trainer.train_step

    def step_then_stop(step):
        stats = original(step)
        if step == 2:
            trainer.stop.requested = True  # what the SIGINT/SIGTERM handler sets
        return stats

    trainer.train_step = step_then_stop
    with pytest.raises(TrainingInterrupted, match="--resume"):
        trainer.fit()
    latest = (tmp_path / "run" / "checkpoints" / "latest").read_text().strip()
    assert latest == "step-000002"
    pretrain(TrainConfig.load(tmp_path / "run" / "config.json"), resume=True, progress=False)
    steps = [json.loads(x).get("step") for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4, 5, 5]  # every step once (the last is the final evaluation)


def test_sigterm_stops_pretrain_after_the_current_step(tmp_path, corpus):
    config = _tiny_config(tmp_path / "run", corpus, max_steps=10_000)
    timer = threading.Timer(3.0, lambda: os.kill(os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        with pytest.raises(TrainingInterrupted) as stopped:
            pretrain(config, progress=False)
    finally:
        timer.cancel()
    assert -1 <= stopped.value.step < 10_000  # -1: stopped before the first step finished
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is removed again


def test_an_existing_run_is_not_restarted_silently(tmp_path, corpus):
    config = _tiny_config(tmp_path / "run", corpus, max_steps=2)
    pretrain(config, progress=False)
    with pytest.raises(FileExistsError, match="--resume"):
        Trainer(config, progress=False)
    Trainer(config, progress=False, overwrite=True)  # explicit


def test_fast_allocator_env_marks_the_restart():
    env, name = fast_allocator_env({"PATH": "/bin"})
    assert env["MOECTL_ALLOCATOR"] == name and name in ("tcmalloc", "system")
    assert ("tcmalloc" in env.get("LD_PRELOAD", "")) == (name == "tcmalloc")


def test_kernel_breakdown_splits_a_step_and_bounds_mfu(tmp_path, corpus):
    config = _tiny_config(tmp_path / "run", corpus, max_steps=10)
    result = measure_training(config, steps=2, warmup=1, breakdown=True)
    k = result["kernels"]
    assert k["matmul_s"] > 0 and k["attention_s"] >= 0 and k["other_s"] >= 0
    assert k["matmul_s"] + k["attention_s"] + k["other_s"] == pytest.approx(k["step_s"])
    # everything but the kernels taking no time can only raise MFU
    assert result["mfu_ceiling"] > result["mfu_bf16"] * result["step_s"] / k["step_s"] * 0.999
    assert result["matmul_flops"] > 0


def testkernel_kinds():
    assert kernel_kind("aten::mm") == kernel_kind("aten::addmm") == "matmul"
    assert kernel_kind("aten::_scaled_dot_product_flash_attention_for_cpu_backward") == "attention"
    assert kernel_kind("aten::_efficient_attention_backward") == "attention"  # CUDA's
    assert kernel_kind("aten::mul") == "other"
