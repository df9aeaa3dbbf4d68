"""Pretraining: packing, pool sizes, losses, a tiny run, exact resume, plain-transformers loading."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import moectl
from moectl.routing.pool import sample_pool_sizes, segment_starts
from moectl.train.loop import Trainer
from moectl.train.packing import batch_indices, pack_documents
from moectl.train.pretrain_losses import expert_counts, load_balancing_loss, router_z_loss
from moectl.train.train_config import TrainConfig

MICRO_MODEL = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "intermediate_size": 64,
}


def _config(tmp_path, corpus, **kw):
    values = dict(
        out=str(tmp_path / "run"),
        corpus=str(corpus),
        seq_len=64,
        micro_batch=4,
        max_steps=6,
        warmup_steps=1,
        log_every=1,
        checkpoint_every=3,
        model=MICRO_MODEL,
        final_eval_batches=2,
        lr=3e-3,
    )
    values.update(kw)
    return TrainConfig(**values)


def test_pack_documents_keeps_document_ids():
    packed = pack_documents(
        [[5, 6, 7], [8, 9], [10, 11, 12, 13]], [0, 1, 0], seq_len=4, eos_id=2, domains=["a", "b"]
    )
    assert packed.ids.tolist() == [[5, 6, 7, 2], [8, 9, 2, 10], [11, 12, 13, 2]]
    assert packed.doc_ids.tolist() == [[0, 0, 0, 0], [1, 1, 1, 2], [2, 2, 2, 2]]
    assert packed.domain.tolist() == [[0, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]]


def test_batches_are_a_function_of_the_step():
    a = batch_indices(10, seed=3, step=4, micro=1, rank=0, grad_accum=2, world=1, size=3)
    b = batch_indices(10, seed=3, step=4, micro=1, rank=0, grad_accum=2, world=1, size=3)
    assert torch.equal(a, b)
    # the micro-batches of one epoch cover every row exactly once
    seen = torch.cat([batch_indices(12, 0, s, m, 0, 2, 1, 3) for s in range(2) for m in range(2)])
    assert sorted(seen.tolist()) == list(range(12))


def test_pool_sizes_constant_per_document_and_in_range():
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 6, 6, 6]])
    d = sample_pool_sizes(doc_ids, k=2, n_r=8, generator=torch.Generator().manual_seed(0))
    starts = segment_starts(doc_ids)
    assert torch.equal(d, d.gather(1, starts))
    assert d.min() >= 2 and d.max() <= 8
    draws = sample_pool_sizes(torch.arange(4000).view(1, -1), 2, 8, torch.Generator().manual_seed(1))
    assert set(draws.unique().tolist()) == set(range(2, 9))  # U{k, ..., n_r}


def test_load_balancing_is_one_times_k_at_uniform_routing():
    logits = torch.zeros(1, 8, 4, requires_grad=True)  # uniform p
    chosen = torch.tensor([[[0, 1], [2, 3]] * 4])
    valid = torch.ones(1, 8, dtype=torch.bool)
    counts = expert_counts(chosen, valid, 4)
    assert counts.tolist() == [4, 4, 4, 4]
    lb = load_balancing_loss(logits, valid, counts, valid.sum())
    assert lb.item() == pytest.approx(2.0)  # n_r * sum f_i P_i = 4 * 4 * (2/4 * 1/4) = k
    lb.backward()
    assert logits.grad is not None
    z = router_z_loss(torch.zeros(1, 3, 4), torch.ones(1, 3, dtype=torch.bool))
    assert z.item() == pytest.approx(torch.log(torch.tensor(4.0)).item() ** 2)


@pytest.mark.parametrize("objective", ["standard", "emo"])
def test_tiny_run_lowers_loss_and_loads_with_transformers(tmp_path, corpus, objective):
    config = _config(
        tmp_path, corpus, objective=objective, max_steps=12, checkpoint_every=0, final_eval_batches=0
    )
    trainer = Trainer(config, progress=False)
    before = trainer.evaluate(batches=2)["val_loss"]
    result = trainer.fit()
    assert result["val_loss"] < before - 0.5
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")  # no moectl involved
    assert model.config.model_type == "qwen2_moe"
    info = moectl.inspect(model)
    assert info.num_experts == 8 and info.top_k == 2 and info.layers[0].shared_experts == 1
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert log[-1]["final"] and set(log[-1]["val_loss_per_domain"]) >= {"code", "legal"}
    assert (tmp_path / "run" / "loss_curve.png").exists()


@pytest.mark.parametrize("objective", ["standard", "emo"])
def test_resume_reproduces_next_step_exactly(tmp_path, corpus, objective):
    config = _config(tmp_path, corpus, objective=objective, max_steps=5, grad_accum=2)
    straight = Trainer(config, progress=False)
    for step in range(3):
        straight.train_step(step)
    straight.save(2)
    expected = straight.train_step(3)
    resumed = Trainer(config, resume=True, progress=False)
    assert resumed.start_step == 3
    got = resumed.train_step(3)
    assert got["loss"] == expected["loss"] and got["ce"] == expected["ce"] and got["lb"] == expected["lb"]


def test_checkpoints_are_atomic_and_pruned(tmp_path, corpus):
    config = _config(tmp_path, corpus, max_steps=7, checkpoint_every=2, keep_checkpoints=2)
    Trainer(config, progress=False).fit()
    root = tmp_path / "run" / "checkpoints"
    kept = sorted(p.name for p in root.glob("step-*"))
    assert kept == ["step-000005", "step-000006"]
    assert (root / "latest").read_text() == "step-000006"
    assert not list(root.glob(".tmp-*"))


def test_bad_config_refused():
    with pytest.raises(ValueError, match="objective must be 'standard' or 'emo'"):
        TrainConfig(out="x", objective="moe")
    with pytest.raises(ValueError, match="preset must be one of tiny, small"):
        TrainConfig(out="x", preset="huge")
    with pytest.raises(ValueError, match="lb_scope"):
        TrainConfig(out="x", lb_scope="batch")
