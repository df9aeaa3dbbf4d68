"""Measured load latency of one expert, and its conversion into a deliberation cost η.

TE-MoE trains its controller with a deliberation cost η (§4.3, eq. 9): a margin, in reward units
(the per-token reverse KL to the teacher, nats), that a switch must beat. §A4 leaves grounding η
in measured expert-loading latency open. moectl converts seconds to reward units in two steps:

1. a switch costs ``switch_s = experts_loaded_per_switch × load_s`` seconds of loading
   (``load_s``: measured latency of one expert from the store to the compute device);
2. relative to the time to compute one token, ``switch_s / token_s`` is the switch's cost in
   tokens of delay; ``nats_per_token_delay`` (the user's exchange rate: how much per-token KL one
   would give up to avoid one token's worth of delay) turns that into reward units.

    η = nats_per_token_delay × experts_loaded_per_switch × load_s / token_s

Per layer: the controller's options are per layer, so ``experts_loaded_per_switch`` is the
experts of one layer's option that are not already resident (k-hat when options are disjoint).
"""

from __future__ import annotations

import statistics
import time

from moectl.errors import ConfigError


def measure_load_latency(store, layer: int = 0, experts: list[int] | None = None, repeats: int = 3) -> dict:
    """Median seconds to load one expert of ``layer`` from ``store`` into a fresh tensor.

    For the disk store this is a memory-mapped read (plus the checksum, if the store verifies);
    recently written files are usually in the OS page cache, so this is a page-cache→RAM copy
    unless the cache was dropped. On a GPU, the copy to the device is what ``ResidentSet`` times.
    """
    import torch

    experts = list(range(4)) if experts is None else experts
    times, nbytes = [], 0
    for _ in range(repeats):
        for e in experts:
            t0 = time.perf_counter()
            weights = store.load(layer, e)
            copies = {n: w.clone() for n, w in weights.items()}
            if any(c.is_cuda for c in copies.values()):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            nbytes = sum(w.numel() * w.element_size() for w in weights.values())
    median = statistics.median(times)
    return {
        "store": getattr(store, "kind", type(store).__name__),
        "load_s": median,
        "expert_bytes": nbytes,
        "bandwidth_bytes_per_s": nbytes / median if median > 0 else float("inf"),
        "samples": len(times),
    }


def deliberation_cost(
    load_s: float, token_s: float, experts_loaded_per_switch: int, nats_per_token_delay: float = 1.0
) -> float:
    """η in reward units for one switch of one layer (see the module docstring)."""
    if load_s < 0 or token_s <= 0 or experts_loaded_per_switch < 0 or nats_per_token_delay < 0:
        raise ConfigError(
            "need load_s >= 0, token_s > 0, experts_loaded_per_switch >= 0, nats_per_token_delay >= 0"
        )
    return nats_per_token_delay * experts_loaded_per_switch * load_s / token_s
