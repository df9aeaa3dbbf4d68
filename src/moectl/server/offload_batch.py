"""Generate greedily with experts offloaded and report memory, traffic and time, JSON-ready.

``moectl serve-offload`` is :func:`run` of a :class:`ServeOffloadConfig` (the model, the prompts and
the offload settings); :func:`serve_offload` does the same for a model already loaded::

    from moectl.offload import OffloadConfig
    from moectl.server import ServeOffloadConfig, run_serve_offload
    result = run_serve_offload(ServeOffloadConfig("tiny:olmoe", OffloadConfig(budget=4, store="host")))
    print(result["hit_rate"], result["bytes_moved_per_token"])
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from moectl.engine import Engine, EngineConfig, SamplingParams
from moectl.errors import ConfigError
from moectl.generate import Prompt, load_prompts
from moectl.io.peak_rss import peak_rss_report
from moectl.offload.cost import deliberation_cost, measure_load_latency
from moectl.offload.offload_config import OffloadConfig
from moectl.quant.quant_config import check_scheme
from moectl.runconfig import RunConfig


@dataclass
class ServeOffloadConfig(RunConfig):
    """One ``serve-offload`` run: which model, which prompts, how many tokens, and the offload settings.

    ``model``: ``tiny:FAMILY``, a checkpoint folder (its experts then stay in its shards, read on
    demand) or a hub id. ``prompts``: a JSONL file (``prompt`` per line), the prompts themselves,
    or None for the built-in set. ``offload.policy`` is a spec string (``lru``, ``option:8``,
    ``controller:DIR``, a policy file) or a residency policy object. ``seed`` seeds a tiny model's
    weights and a controller's sampling. ``max_batch``: prompts decoded together by the engine.
    ``routing``: a routing every prompt is served with, beside the residency policy (``topk:N``,
    an expert mask, forced/omitted experts: anything a server's ``--routing`` takes), or None.
    """

    kind: ClassVar[str] = "serve-offload config"

    model: str
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    prompts: list[str] | Path | None = None
    max_new_tokens: int = 64
    max_batch: int = 1
    plot: Path | None = None
    seed: int = 0
    device: str = "cpu"
    dtype: str = "auto"
    routing: str | None = None
    quantize: str | None = None

    def __post_init__(self) -> None:
        check_scheme(self.quantize)
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens (--max-new-tokens) must be >= 1, got {self.max_new_tokens}")
        if self.max_batch < 1:
            raise ConfigError(f"max_batch (--max-batch) must be >= 1, got {self.max_batch}")
        if isinstance(self.prompts, str):
            self.prompts = Path(self.prompts)


def run(config: ServeOffloadConfig, *, progress: bool = True) -> dict:
    """Load ``config.model`` for offloading and generate its prompts (:func:`serve_offload`).

    A checkpoint folder under a disk or checkpoint store is loaded lazily (experts stay in its
    shards; the budget pre-flighted before any weight is read, ``offload/loading.py``); anything
    else loads whole and is then offloaded. A ``controller:`` policy merges its adapters into the
    model and samples with ``config.seed``. Returns :func:`serve_offload`'s results.
    """
    from moectl.offload.loading import load_for_offload
    from moectl.offload.residency import ControllerResidency, parse_policy

    torch.manual_seed(config.seed)
    offload = config.offload
    prompts = config.prompts if isinstance(config.prompts, list) else load_prompts(config.prompts)
    model, tokenizer, reader = load_for_offload(
        config.model, offload, config.dtype, config.device, config.seed, config.quantize
    )
    try:
        if config.quantize is not None:  # before offloading: the store then holds the quantized experts
            from moectl.loaded import quantize_loaded

            policy = offload.policy if isinstance(offload.policy, str) else None
            quantize_loaded(model, config.quantize, merge_first=[policy] if policy else [])
        residency = offload.policy
        if isinstance(residency, str):
            residency = parse_policy(residency, model)  # a controller's adapters and routers merge into model
        if isinstance(residency, ControllerResidency):
            residency = ControllerResidency(residency.route_policy, seed=config.seed)
        return serve_offload(
            model,
            tokenizer,
            prompts,
            offload.with_(policy=residency),
            config.max_new_tokens,
            plot=config.plot,
            progress=progress,
            reader=reader,
            max_batch=config.max_batch,
            routing=config.routing,
        )
    finally:
        if reader is not None:
            reader.close()




def _io_bytes() -> int | None:
    """Bytes this process has read from storage (Linux ``/proc/self/io`` read_bytes; None elsewhere)."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _first_token_s(step_times: list[float], kinds: list[str]) -> float | None:
    """Mean seconds of the prompts' prefill forwards (each ends with its first new token):
    ``step_times`` holds each forward's start and, last, the end of generation; ``kinds`` each
    forward's kind (the engine's ``forward_log``: prefill | decode)."""
    spans = [step_times[i + 1] - step_times[i] for i, k in enumerate(kinds) if k == "prefill"]
    return sum(spans) / len(spans) if spans else None


def _decode_s(step_times: list[float], kinds: list[str]) -> float:
    """Seconds of the decoding forwards, each from its start to the next forward's."""
    return sum(step_times[i + 1] - step_times[i] for i, k in enumerate(kinds) if k == "decode")


def _tensor_bytes(model) -> int:
    """Bytes of the model's parameters and buffers that hold memory (shared ones once, meta none)."""
    seen = {}
    for t in [*model.parameters(), *model.buffers()]:
        if not t.is_meta:
            seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def serve_offload(
    model,
    tokenizer,
    prompts: list[Prompt] | list[str],
    config: OffloadConfig,
    max_new_tokens: int = 64,
    *,
    plot: str | Path | None = None,
    progress: bool = True,
    reader=None,
    max_batch: int = 1,
    routing: Any = None,
) -> dict:
    """Generate ``max_new_tokens`` per prompt (greedy) with offloaded experts, through the engine.

    ``max_batch``: prompts decoded together (continuous batching; 1: one prompt at a time, as the
    figures of earlier versions were measured). The rows of a batch share one resident set.
    ``config``: the budget, residency policy, store and loader settings (``OffloadConfig``).
    ``reader``: the checkpoint's shard reader when the model was loaded lazily
    (``moectl.models.load_lazy``): its experts are then read from the checkpoint's own shards.
    ``routing``: a routing spec every prompt is served with (``topk:N``, a mask, …), or None.
    Returns the generated texts and the measured figures; ``plot`` writes the load timeline PNG.
    ``load_s`` is the loads' own time, ``stall_s`` the part of it compute waited for (equal when
    loads are synchronous; ``expert_loader.py``); ``load_overlap`` = 1 - stall_s / load_s.
    """
    prompts = [p if isinstance(p, Prompt) else Prompt(p) for p in prompts]
    # the engine runs offloaded experts with their eager forward and restores the implementation on close
    impl = getattr(model.config, "_experts_implementation", None)
    return _serve(model, tokenizer, prompts, config, max_new_tokens, plot, progress, reader, impl, max_batch, routing)


def _serve(model, tokenizer, prompts, config, max_new_tokens, plot, progress, reader, impl, max_batch, routing) -> dict:
    total_params = _tensor_bytes(model)
    io0 = _io_bytes()
    routings = {"served": routing} if routing is not None else None
    engine_config = EngineConfig(max_batch=max_batch, offload=config, log_forwards=True)
    engine = Engine(model, tokenizer, engine_config, routings=routings, reader=reader)
    with engine:
        rt = engine.runtime
        non_expert_bytes = _tensor_bytes(model)
        t0, c0 = time.perf_counter(), time.process_time()
        params = SamplingParams(max_tokens=max_new_tokens, ignore_eos=True)
        done = engine.generate([p.text for p in prompts], params, routing=routings and "served", progress=progress)
        texts = [c.text for c in done]
        t1 = time.perf_counter()
        wall, cpu = t1 - t0, time.process_time() - c0
        io1 = _io_bytes()
        read_stats = getattr(getattr(rt.store, "io", None), "stats", None)
        shard_bytes = None if read_stats is None else read_stats.file_bytes
        shard_gbps = None if read_stats is None else read_stats.gb_per_s
        kinds = [kind for kind, _ in engine.forward_log]
        ttft = _first_token_s([*rt.step_times, t1], kinds)
        decode_s = _decode_s([*rt.step_times, t1], kinds)
        decode_tokens = sum(rows for kind, rows in engine.forward_log if kind == "decode")
        totals = rt.totals()
        events = rt.events()
        step_tokens = list(rt.step_tokens)
        latency = measure_load_latency(rt.store, 0, list(range(min(4, rt.info.layers[0].num_experts))))
        info = rt.info
        budget_experts = rt.budget
        loader, async_on, prefetch_on = rt.loader_name, rt.async_loads, rt.prefetch
        policy_report = rt.policy.report()
        store = rt.store_kind
        read_method = rt.store.method if store == "checkpoint" else None
    generated = len(prompts) * max_new_tokens
    decode_steps = {s for s, kind in enumerate(kinds, 1) if kind == "decode"}
    decode_loads = [e for e in events if e[0] in decode_steps]
    expert_bytes = totals["expert_bytes"]
    total_expert_bytes = sum(
        b * layer.num_experts for b, layer in zip(totals["stored_expert_bytes"], info.layers, strict=True)
    )
    accesses = totals["hits"] + totals["misses"]
    token_s = max(wall - totals["stall_s"], 1e-9) / max(generated, 1)  # per-token time not held by loads
    load_s = totals["load_s"] / max(totals["loads"], 1)
    stall_per_load = totals["stall_s"] / max(totals["loads"], 1)
    k_hat = rt.policy.k_hat if rt.policy.k_hat is not None else info.top_k
    pinned = rt.policy.pins  # keeps an option resident: switches count
    result = {
        "policy": rt.policy.name,
        "routing": routing if routing is None or isinstance(routing, str) else type(routing).__name__,
        "store": store,
        "read_method": read_method,
        "config": config.to_dict(),
        "experts_implementation": "eager" if impl in (None, "eager") else f"eager (switched from {impl})",
        "budget_experts_per_layer": budget_experts,
        "num_experts": [layer.num_experts for layer in info.layers],
        "top_k": info.top_k,
        "prompts": len(prompts),
        "generated_tokens": generated,
        "texts": texts,
        "resident_expert_bytes": totals["resident_expert_bytes"],
        "total_expert_bytes": total_expert_bytes,
        "non_expert_bytes": non_expert_bytes,
        "model_bytes_in_memory": total_params,
        "expert_bytes_per_expert": expert_bytes,
        **peak_rss_report(),
        "loads": totals["loads"],
        "bytes_moved": totals["bytes_moved"],
        "decode_loads": len(decode_loads),
        "decode_bytes_moved": sum(expert_bytes[layer] for _, layer, _ in decode_loads),
        "loads_per_token": len(decode_loads) / max(generated, 1),
        "bytes_moved_per_token": sum(expert_bytes[layer] for _, layer, _ in decode_loads) / max(generated, 1),
        "hits": totals["hits"],
        "misses": totals["misses"],
        "hit_rate": totals["hits"] / accesses if accesses else None,
        "switches": totals["switches"],
        "switch_rate": (
            totals["switches"] / (len(decode_steps) * len(info.layers))
            if pinned and decode_steps and max_batch == 1  # the runtime counts ω changes of one-row steps
            else None
        ),
        "switch_rate_unmeasured": (  # why switch_rate is None, in words a table can print
            f"{rt.policy.name} keeps no option resident" if not pinned
            else "prompts decoded together share one resident set; measured with --max-batch 1"
            if max_batch != 1 else "no decoding step" if not decode_steps else None
        ),
        "loader": loader,
        "async_loads": async_on,
        "load_s": totals["load_s"],
        "stall_s": totals["stall_s"],
        "wait_s": totals["wait_s"],
        "stall_s_per_token": totals["stall_s"] / max(generated, 1),
        "load_overlap": 1 - totals["stall_s"] / totals["load_s"] if totals["load_s"] > 0 else None,
        "prefetch": prefetch_on,
        "policy_report": policy_report,
        "prefetch_loads": totals["prefetch_loads"],
        "prefetch_hits": totals["prefetch_hits"],
        "prefetch_wasted": totals["prefetch_wasted"],
        "prefetch_unused": totals["prefetch_unused"],
        "prefetch_hit_rate": (
            totals["prefetch_hits"] / totals["prefetch_loads"] if totals["prefetch_loads"] else None
        ),
        "expert_compute_s": totals["compute_s"],
        "wall_s": wall,
        "tokens_per_s": generated / wall if wall > 0 else None,
        "cpu_s": cpu,  # process CPU time: steadier than wall time on a shared machine
        "tokens_per_cpu_s": generated / cpu if cpu > 0 else None,
        "load_latency": latency,
        "eta": {
            "value": deliberation_cost(load_s, token_s, k_hat),
            "formula": "nats_per_token_delay(=1) x k_hat x load_s / token_s (moectl.offload.cost); "
            "stall_value: the same with stall_s per load (the part of a load compute waits for)",
            "load_s": load_s,
            "token_s": token_s,
            "experts_loaded_per_switch": k_hat,
            "stall_value": deliberation_cost(stall_per_load, token_s, k_hat),
            "stall_s_per_load": stall_per_load,
        },
        "time_to_first_token_s": ttft,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s > 0 else None,
        "max_batch": max_batch,
        "disk_read_bytes": None if io0 is None or io1 is None else io1 - io0,
        "disk_read_bytes_per_token": None if io0 is None or io1 is None else (io1 - io0) / max(generated, 1),
        "shard_read_bytes": shard_bytes,
        "shard_read_gb_per_s": shard_gbps,
        "timeline": {"steps": len(step_tokens), "loads": [list(e) for e in events]},
    }
    if plot is not None:
        from moectl.reporting.offload_plots import plot_timeline  # matplotlib only when plotting

        result["plot"] = str(
            plot_timeline(
                events,
                kinds,
                info,
                plot,
                title=f"policy {rt.policy.name}, {budget_experts[0]} of {info.layers[0].num_experts} experts "
                f"resident per MoE layer, {store} store",
            )
        )
    return result
