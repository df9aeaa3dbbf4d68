"""Training speed against the machine: model FLOPs per token, the measured matmul peak, and MFU.

MFU = model FLOPs per token × tokens/s ÷ the peak FLOP/s of a dense matmul measured on the same
machine, threads and dtype (the issue's definition: the bf16 peak, since bf16 is what trains).
Model FLOPs follow the PaLM convention (Chowdhery et al. 2022, App. B): 6 per active matmul
parameter per token (forward 2, backward 4) — the attention projections, the top-k routed experts,
the shared expert, the routers and the LM head; embeddings are a lookup — plus 12·L·T·d_attn for
the attention scores and values (non-causal count, as PaLM: causal kernels may skip half).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

import torch


def matmul_peak(dtype: torch.dtype = torch.bfloat16, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of an n×n by n×n matmul in ``dtype`` on this process's threads (best of ``repeats``)."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def flops_per_token(config: Any, seq_len: int) -> float:
    """Training FLOPs per token of a Qwen2-MoE-style config (see the module docstring)."""
    h = config.hidden_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    attn_params = h * heads * head_dim * 2 + h * kv * head_dim * 2  # q, o; k, v
    experts = config.num_experts_per_tok * 3 * h * config.moe_intermediate_size
    shared = 3 * h * getattr(config, "shared_expert_intermediate_size", 0)
    router = h * config.num_experts + (h if shared else 0)  # + the shared expert's sigmoid gate
    per_layer = attn_params + experts + shared + router
    head = h * config.vocab_size
    matmul_params = config.num_hidden_layers * per_layer + head
    attention = 12 * config.num_hidden_layers * seq_len * heads * head_dim
    return 6.0 * matmul_params + attention


def measure_training(train_config: Any, steps: int = 10, warmup: int = 3) -> dict[str, Any]:
    """Median tokens/s of ``Trainer.train_step`` over ``steps`` steps after ``warmup``, with MFU.

    Runs the real step (routing hooks, load balancing, optimizer) on the configured data; the run
    folder is a temporary one unless ``train_config.out`` is given.
    """
    from moectl.train.loop import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        if not train_config.out:
            train_config.out = tmp
        trainer = Trainer(train_config, progress=False, overwrite=True)
        tokens = train_config.tokens_per_step()
        times = []
        for step in range(warmup + steps):
            start = time.perf_counter()
            trainer.train_step(step)
            if step >= warmup:
                times.append(time.perf_counter() - start)
        model_config = trainer.raw_model.config
    seconds = statistics.median(times)
    fpt = flops_per_token(model_config, train_config.seq_len)
    peak_bf16 = matmul_peak(torch.bfloat16)
    peak_fp32 = matmul_peak(torch.float32)
    tps = tokens / seconds
    return {
        "tokens_per_s": tps,
        "step_s": seconds,
        "step_s_min": min(times),
        "step_s_all": times,
        "flops_per_token": fpt,
        "achieved_flops": fpt * tps,
        "peak_bf16_flops": peak_bf16,
        "peak_fp32_flops": peak_fp32,
        "mfu_bf16": fpt * tps / peak_bf16,
        "threads": torch.get_num_threads(),
    }
