"""Global load balancing over 2 gloo processes equals the single-process value on the same global batch."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moectl.train.pretrain_losses import all_reduce_sum, expert_counts, load_balancing_loss
from moectl.train.train_config import TrainConfig


def _batch():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 16, 8, generator=generator)
    chosen = logits.topk(2, dim=-1).indices
    # make routing unbalanced and different between the two halves
    chosen[:2, :, 0] = 0
    valid = torch.ones(4, 16, dtype=torch.bool)
    return logits, chosen, valid


def _worker(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    logits, chosen, valid = _batch()
    part = slice(2 * rank, 2 * rank + 2)
    counts = all_reduce_sum(expert_counts(chosen[part], valid[part], 8))
    tokens = all_reduce_sum(valid[part].sum().to(torch.float64))
    local = expert_counts(chosen[part], valid[part], 8)
    lb_global = load_balancing_loss(logits[part], valid[part], counts, tokens)
    lb_micro = load_balancing_loss(logits[part], valid[part], local, valid[part].sum())
    mean = torch.stack([lb_global.detach(), lb_micro.detach()]).double()
    dist.all_reduce(mean)
    queue.put((rank, (mean / 2).tolist()))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_global_lb_over_two_gloo_processes_equals_single_process():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(rank, port, queue)) for rank in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    logits, chosen, valid = _batch()
    single = load_balancing_loss(logits, valid, expert_counts(chosen, valid, 8), valid.sum()).item()
    lb_global, lb_micro = results[0]
    assert results[0] == results[1]
    assert lb_global == pytest.approx(single, rel=1e-6)
    assert abs(lb_micro - single) > 1e-3  # the local (micro-batch) variant is not the same loss


def test_global_scope_spans_gradient_accumulation(tmp_path):
    """lb_scope='global' with 2 micro-batches of 2 rows gives the LB of one micro-batch of 4 rows."""
    from moectl.data.sample import load_sample_corpus
    from moectl.train.loop import Trainer
    from test_train import MICRO_MODEL

    docs = load_sample_corpus("train")["train"][:40]
    root = tmp_path / "corpus"
    root.mkdir()
    for split in ("train", "validation"):
        (root / f"{split}.jsonl").write_text(
            "\n".join(json.dumps({**d, "text": d["text"][:2000]}) for d in docs)
        )
    common = dict(corpus=str(root), seq_len=32, warmup_steps=0, max_steps=2, model=MICRO_MODEL)

    def lb(name: str, micro_batch: int, grad_accum: int, scope: str) -> float:
        config = TrainConfig(
            out=str(tmp_path / name), micro_batch=micro_batch, grad_accum=grad_accum, lb_scope=scope, **common
        )
        return Trainer(config, progress=False).train_step(0)["lb"]

    single = lb("one", 4, 1, "global")
    assert lb("global", 2, 2, "global") == pytest.approx(single, rel=1e-5)
    assert lb("micro", 2, 2, "micro") != pytest.approx(single, rel=1e-5)
