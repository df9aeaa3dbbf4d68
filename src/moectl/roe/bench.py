"""RoE inference cost: per-token latency, peak memory and KV-cache bytes vs K (RoE §3.3, Figure 4).

For each cache variant (clean, separate, none) and K, greedy decoding of ``new_tokens`` tokens
after a prompt, as ratios to the plain model (its own decoding loop with a ``DynamicCache``, no
routing hooks) measured in the same run. Configurations are interleaved round-robin over
``repeats``. Latency is per decoded token (prefill excluded) in process CPU time
(``time.process_time``), taking the minimum over repeats — the run least disturbed by other work
on a shared machine, as ``benchmarks/routing_overhead.py`` does; run with one torch thread for
that to be meaningful. Wall-clock per-token times (also minimum over repeats) are reported beside.

Memory, on CPU: peak tensor memory = model weights + the peak of live tensor bytes allocated
during prefill + decoding, summed from the PyTorch profiler's allocator events (kineto
``[memory]`` records, ``profile_memory=True``) in a separate, unprofiled-for-time run — i.e.
what the tensors need, without allocator slack or the interpreter. On CUDA:
``torch.cuda.max_memory_allocated``. The KV cache is also measured directly: bytes of the
distinct storages its layers hold at the end of decoding (``cache.cache_bytes``).

Every RoE run uses tau = ``tau`` on every MoE layer (noise on, so the re-routing cost counts);
output lengths are fixed (EOS ignored) so every configuration does the same work. RoE runs its
steps with the grouped (batched) experts kernel (``ensemble.experts_implementation``); the row
"plain, grouped experts" shows the plain model with that kernel too, so a ratio below 1 there
would mean the kernel, not RoE, made the difference.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo, inspect
from moectl.ensemble.cache_size import cache_bytes
from moectl.ensemble.ensemble import Ensemble, experts_implementation
from moectl.ensemble.roe_config import CACHE_MODES, MAX_K, RoEConfig
from moectl.errors import ConfigError
from moectl.progress import progress_bar
from moectl.routing.kv_cache import cache_out, with_cache

Runner = Callable[[], tuple[float, float, int]]  # → (CPU s per token, wall s per token, KV cache bytes)


class _Clock:
    """Accumulates process CPU time and wall time over the timed sections of one run."""

    def __init__(self) -> None:
        self.cpu = self.wall = 0.0
        self.steps = 0

    def __enter__(self) -> _Clock:
        self._cpu, self._wall = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cpu += time.process_time() - self._cpu
        self.wall += time.perf_counter() - self._wall
        self.steps += 1

    def per_step(self) -> tuple[float, float]:
        return self.cpu / max(self.steps, 1), self.wall / max(self.steps, 1)


def _plain_run(model: nn.Module, ids: Tensor, mask: Tensor, new_tokens: int) -> tuple[float, float, int]:
    clock = _Clock()
    with torch.no_grad():
        position = (mask.long().cumsum(1) - 1).clamp(min=0)
        out = model(
            input_ids=ids, attention_mask=mask, position_ids=position, use_cache=True, logits_to_keep=1
        )
        cache = cache_out(out)
        position = position[:, -1:]
        for _ in range(new_tokens - 1):
            with clock:
                token = out.logits[:, -1].float().log_softmax(-1).argmax(-1)
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
                position = position + 1
                out = model(
                    input_ids=token[:, None],
                    attention_mask=mask,
                    position_ids=position,
                    **with_cache(cache),
                    use_cache=True,
                )
    return *clock.per_step(), cache_bytes(cache)


def _roe_run(
    model: nn.Module, ids: Tensor, mask: Tensor, new_tokens: int, config: RoEConfig, info: ModelInfo
) -> tuple[float, float, int]:
    clock = _Clock()
    with Ensemble(model, config, info=info) as ens:
        out = ens.start(ids, mask)
        for _ in range(new_tokens - 1):
            with clock:
                out = ens.step(out.logprobs.argmax(-1))
        kv = cache_bytes(ens.variant.cache)
    return *clock.per_step(), kv


def _weights_bytes(model: nn.Module) -> int:
    seen = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def peak_tensor_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes of live tensors allocated while ``fn`` runs (above what was live before)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def measure_overhead(
    model: nn.Module,
    ids: Tensor,
    mask: Tensor,
    Ks: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
    variants: Sequence[str] = CACHE_MODES,
    new_tokens: int = 32,
    repeats: int = 3,
    tau: float = 0.3,
    memory: bool = True,
    progress: bool = True,
    info: ModelInfo | None = None,
) -> dict:
    """Latency, peak memory and KV bytes for each (variant, K) as ratios to the plain model."""
    if new_tokens < 2:
        raise ConfigError(f"new_tokens must be >= 2 (latency is measured on decode steps), got {new_tokens}")
    bad = [k for k in Ks if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K]
    if bad:
        raise ConfigError(f"every K must be an integer >= 1 and <= {MAX_K}, got {bad}")
    unknown = [v for v in variants if v not in CACHE_MODES]
    if unknown:
        raise ConfigError(f"unknown cache variants {unknown}; choose from {', '.join(CACHE_MODES)}")
    info = info or inspect(model)
    device = ids.device
    runners: dict[tuple[str, int], Runner] = {("plain", 0): lambda: _plain_run(model, ids, mask, new_tokens)}

    def plain_grouped() -> tuple[float, float, int]:
        with experts_implementation(model, "grouped_mm"):
            return _plain_run(model, ids, mask, new_tokens)

    runners[("plain, grouped experts", 0)] = plain_grouped
    for variant in variants:
        for k in Ks:
            config = RoEConfig(K=k, tau=tau, cache=variant, seed=0)
            runners[(variant, k)] = lambda c=config: _roe_run(model, ids, mask, new_tokens, c, info)
    times: dict[tuple[str, int], list[float]] = {key: [] for key in runners}
    walls: dict[tuple[str, int], list[float]] = {key: [] for key in runners}
    kv: dict[tuple[str, int], int] = {}
    peak: dict[tuple[str, int], int] = {}
    total = len(runners) * (repeats + 1 + int(memory))
    with progress_bar("benchmark", progress) as bar:
        task = bar.add_task("bench", total=total)
        for key, run in runners.items():  # warm-up (also the KV measurement)
            kv[key] = run()[2]
            bar.advance(task)
        for _ in range(repeats):
            for key, run in runners.items():
                cpu, wall, _ = run()
                times[key].append(cpu)
                walls[key].append(wall)
                bar.advance(task)
        if memory:
            for key, run in runners.items():
                peak[key] = peak_tensor_bytes(run, device)
                bar.advance(task)
    weights = _weights_bytes(model)
    base_t = min(times[("plain", 0)])
    base_w = min(walls[("plain", 0)])
    base_m = weights + peak.get(("plain", 0), 0)
    base_kv = kv[("plain", 0)]
    rows = []
    for (variant, k), ts in times.items():
        t, w = min(ts), min(walls[(variant, k)])
        m = weights + peak.get((variant, k), 0)
        rows.append({
            "variant": variant,
            "K": k if not variant.startswith("plain") else None,
            "ms_per_token": t * 1e3,
            "latency_ratio": t / base_t,
            "wall_ms_per_token": w * 1e3,
            "wall_latency_ratio": w / base_w,
            "peak_bytes": m if memory else None,
            "memory_ratio": m / base_m if memory else None,
            "kv_cache_bytes": kv[(variant, k)],
            "kv_ratio": kv[(variant, k)] / base_kv if base_kv else None,
        })  # fmt: skip
    return {
        "device": str(device),
        "prompt_tokens": int(ids.shape[1]),
        "batch": int(ids.shape[0]),
        "new_tokens": new_tokens,
        "repeats": repeats,
        "torch_threads": torch.get_num_threads(),
        "latency_method": "process CPU time per decoded token, minimum over repeats",
        "tau": tau,
        "weights_bytes": weights,
        "memory_method": "torch.cuda.max_memory_allocated"
        if device.type == "cuda"
        else "weights + peak live tensor bytes from torch.profiler allocator events",
        "rows": rows,
    }
