"""Training speed against the machine: model FLOPs per token, the measured matmul peak, and MFU.

MFU = model FLOPs per token × tokens/s ÷ the peak FLOP/s of a dense matmul measured on the same
machine, threads and dtype (the issue's definition: the bf16 peak, since bf16 is what trains).
Model FLOPs follow the PaLM convention (Chowdhery et al. 2022, App. B): 6 per active matmul
parameter per token (forward 2, backward 4) — the attention projections, the top-k routed experts,
the shared expert, the routers and the LM head; embeddings are a lookup — plus 12·L·T·d_attn for
the attention scores and values (non-causal count, as PaLM: causal kernels may skip half).

:func:`kernel_breakdown` profiles steps and splits their time into matmul kernels, attention kernels
and everything else, which bounds MFU from above for a model and machine: the MFU the step would
reach if every other op took no time (the ``ceiling``).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

import torch


def matmul_peak(
    dtype: torch.dtype = torch.bfloat16, n: int = 2048, repeats: int = 5, device: torch.device | str = "cpu"
) -> float:
    """FLOP/s of an n×n by n×n matmul in ``dtype`` on ``device`` (the CPU: this process's threads;
    best of ``repeats``; a CUDA device is synchronised around each product, and n is at least 8192
    there, so the product outlasts a kernel launch). On the CPU n grows from 256 by doubling up to
    ``n`` while one product takes under :data:`PEAK_PRODUCT_S`: a CPU without native bf16 products
    (AMD EPYC here) runs a 2048² bf16 product in minutes, not milliseconds."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    n = max(n, 8192) if cuda else _cpu_size(dtype, n)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        a @ b
        if cuda:
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


PEAK_PRODUCT_S = 0.05  # a CPU product this long measures the peak well enough


def _cpu_size(dtype: torch.dtype, largest: int) -> int:
    """The matrix size :func:`matmul_peak` times on the CPU (see there)."""
    size = min(256, largest)
    while size < largest:
        a = torch.randn(size, size).to(dtype)
        start = time.perf_counter()
        a @ a
        if time.perf_counter() - start >= PEAK_PRODUCT_S:
            break
        size *= 2
    return min(size, largest)


def flops_per_token(config: Any, seq_len: int) -> float:
    """Training FLOPs per token of a Qwen2-MoE-style config (see the module docstring)."""
    h = config.hidden_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = _head_dim(config)
    attn_params = h * heads * head_dim * 2 + h * kv * head_dim * 2  # q, o; k, v
    experts = config.num_experts_per_tok * 3 * h * config.moe_intermediate_size
    shared = 3 * h * getattr(config, "shared_expert_intermediate_size", 0)
    router = h * config.num_experts + (h if shared else 0)  # + the shared expert's sigmoid gate
    per_layer = attn_params + experts + shared + router
    head = h * config.vocab_size
    matmul_params = config.num_hidden_layers * per_layer + head
    return 6.0 * matmul_params + attention_flops_per_token(config, seq_len)


MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm")
# SDPA's CPU flash kernels and, on CUDA, its flash / memory-efficient / cuDNN kernels (forward, backward)
ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")


def kernel_kind(name: str) -> str:
    if name in MATMUL_OPS:
        return "matmul"
    if any(part in name for part in ATTENTION_OPS):
        return "attention"
    return "other"


def kernel_breakdown(trainer: Any, first_step: int, steps: int = 2) -> dict[str, float]:
    """Seconds per step in matmul kernels, attention kernels and the rest, over ``steps`` profiled
    training steps from ``first_step``.

    Each op's self time is counted once (a ``linear``'s time lands on its ``mm``); "other" is the
    step's wall time minus the two kernel kinds, so it holds the elementwise ops, copies, indexing,
    the optimizer and the Python between ops. The profiler adds a little to every op, so the
    figures are of a slightly slower step than :func:`measure_training` times.
    """
    from torch.profiler import ProfilerActivity, profile

    cuda = trainer.accelerator.device.type == "cuda"  # then the kernels' device time
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for step in range(first_step, first_step + steps):
            trainer.train_step(step)
        if cuda:
            torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps
    kinds = {"matmul": 0.0, "attention": 0.0}
    for event in prof.key_averages():
        kind = kernel_kind(event.key)
        if kind != "other":
            us = event.self_device_time_total if cuda else event.self_cpu_time_total
            kinds[kind] += us / 1e6 / steps
    return {"step_s": wall, **{f"{k}_s": v for k, v in kinds.items()}, "other_s": wall - sum(kinds.values())}


def attention_flops_per_token(config: Any, seq_len: int) -> float:
    """The attention-score and -value part of :func:`flops_per_token` (what its kernels compute)."""
    return 12.0 * config.num_hidden_layers * seq_len * config.num_attention_heads * _head_dim(config)


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def measure_training(
    train_config: Any, steps: int = 10, warmup: int = 20, breakdown: bool = False
) -> dict[str, Any]:
    """Median tokens/s of ``Trainer.train_step`` over ``steps`` steps after ``warmup``, with MFU.

    Runs the real step (routing hooks, load balancing, optimizer) on the configured data; the run
    folder is a temporary one unless ``train_config.out`` is given. The warm-up is long because
    oneDNN compiles a kernel per new expert-group size (``models.grouped_mm``): a run's first steps
    meet new sizes, its thousands after them mostly cached ones (``small`` preset, bf16: 0.82 s a
    step over steps 3–10, 0.77 s from step 15 on, measured). ``breakdown`` adds
    :func:`kernel_breakdown` of two more steps and the MFU ceiling it implies.
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
        kernels = kernel_breakdown(trainer, warmup + steps) if breakdown else None
    seconds = statistics.median(times)
    fpt = flops_per_token(model_config, train_config.seq_len)
    device = trainer.accelerator.device  # the peak of the device the steps ran on
    peak_bf16 = matmul_peak(torch.bfloat16, device=device)
    peak_fp32 = matmul_peak(torch.float32, device=device)
    tps = tokens / seconds
    extra: dict[str, Any] = {}
    if kernels is not None:
        kernel_s = kernels["matmul_s"] + kernels["attention_s"]
        attention = attention_flops_per_token(model_config, train_config.seq_len)
        extra = {
            "kernels": kernels,
            "matmul_flops": (fpt - attention) * tokens / kernels["matmul_s"],
            "attention_flops": attention * tokens / kernels["attention_s"]
            if kernels["attention_s"]
            else None,
            "mfu_ceiling": fpt * tokens / kernel_s / peak_bf16,
        }
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
        **extra,
    }
