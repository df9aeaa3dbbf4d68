"""A deliberation cost from measured latency (TE-MoE §A4 left it open; beyond the paper).

η stops being a bare hyperparameter: a switch of one layer's option loads up to k-hat experts;
their bytes over the measured copy bandwidth give the switch's seconds, and the measured time
of one decoding step turns seconds into "tokens of delay". ``nats_per_token_delay`` is the
user's exchange rate (per-token KL one would give up to avoid one token's worth of delay):

    η = nats_per_token_delay × k̂ × load_s / token_s      (``moectl.offload.cost.deliberation_cost``)

A switch loads only the experts of its new option that the current one lacks, so
:func:`measure_expert_cost` prices one expert instead (``--eta-bytes-from-latency``); the trainer
charges each switch that price times the experts it brings in (``OptionsConfig.eta_per_expert``):

    eta_per_expert = nats_per_token_delay × load_s / token_s   (nats per expert of expert_bytes bytes)
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from moectl.adapters.inspect import ModelInfo
from moectl.errors import UnsupportedModelError
from moectl.offload.cost import deliberation_cost
from moectl.routing.kv_cache import cache_out, with_cache


def expert_tensors(info: ModelInfo, layer: int = 0, expert: int = 0) -> list[torch.Tensor]:
    """Weights of one routed expert (slices of the stacked 3-D expert parameters, or its own module)."""
    block = info.layers[layer].block
    experts = getattr(block, "experts", None)
    if experts is None:
        raise UnsupportedModelError("cannot find the routed experts of the MoE block")
    if isinstance(experts, nn.ModuleList):
        return [p.detach() for p in experts[expert].parameters()]
    return [p.detach()[expert] for p in experts.parameters(recurse=False) if p.dim() == 3]


def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.no_grad()
def measure_switch_cost(
    model: nn.Module, info: ModelInfo, k_hat: int, nats_per_token_delay: float, repeats: int = 5
) -> dict:
    """Measure one expert's load time and one decoding step's time; return them and η."""
    tensors = expert_tensors(info)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    device = tensors[0].device
    if device.type == "cuda":
        host = [t.cpu().pin_memory() for t in tensors]
        load_s = _timed(lambda: [h.to(device, non_blocking=True) for h in host], repeats)
        path = "pinned host → GPU"
    else:
        load_s = _timed(lambda: [t.clone() for t in tensors], repeats)
        path = "RAM → RAM copy"
    ids = torch.ones(1, 16, dtype=torch.long, device=device)
    out = model(input_ids=ids, use_cache=True)
    cache = cache_out(out)
    step = torch.ones(1, 1, dtype=torch.long, device=device)
    token_s = _timed(lambda: model(input_ids=step, **with_cache(cache), use_cache=True), repeats)
    eta = deliberation_cost(load_s, token_s, k_hat, nats_per_token_delay)
    return {
        "expert_bytes": nbytes,
        "load_s": load_s,
        "bandwidth_bytes_per_s": nbytes / load_s if load_s > 0 else float("inf"),
        "copy": path,
        "token_s": token_s,
        "k_hat": k_hat,
        "nats_per_token_delay": nats_per_token_delay,
        "eta": eta,
    }


def measure_expert_cost(
    model: nn.Module, info: ModelInfo, nats_per_token_delay: float, repeats: int = 5
) -> dict:
    """:func:`measure_switch_cost` of one expert: its load time and one decoding step's time, and
    ``eta_per_expert`` = nats_per_token_delay × load_s / token_s, in nats per expert brought in
    (every routed expert of a model has the same ``expert_bytes``; ``eta_per_byte`` spells that out)."""
    measured = measure_switch_cost(model, info, 1, nats_per_token_delay, repeats)
    per_expert = measured.pop("eta")
    measured.pop("k_hat")
    per_byte = per_expert / measured["expert_bytes"] if measured["expert_bytes"] else 0.0
    return {**measured, "eta_per_expert": per_expert, "eta_per_byte": per_byte}
