"""Replay a routing through per-layer expert caches: hit rate per policy and budget, and the gap to
the offline optimum.

``run(SimConfig) -> list of result rows``: for every budget B and policy, each MoE layer gets its
own cache of B experts (empty at the start) and the trace's tokens are served in order
(``caches.py``: a token's experts resident together). A row reports hits and misses over
tokens × layers × top-k accesses, misses per token (summed over layers), bytes loaded per token
(misses × the expert's bytes, when known) and the gap to Belady's optimum in hit-rate points.

Policies by name: the online ones of ``policies.ONLINE``, ``belady`` (``belady.py``), ``static``
(an offline oracle: the B − k experts the trace uses most in each layer pinned, k slots LRU) and
``static:FILE`` (a subset file's experts pinned, needing B ≥ subset + k).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moectl.errors import ConfigError, FileFormatError
from moectl.residency.belady import BeladyCache
from moectl.residency.caches import ONLINE, Cache, StaticCache
from moectl.residency.trace_input import Accesses

POLICIES = (*ONLINE, "static", "belady")
DEFAULT_POLICIES = ("lru", "lfu", "lfuda", "arc", "s3fifo", "least-stale", "static", "belady")


@dataclass(frozen=True)
class SimConfig:
    accesses: Accesses
    budgets: tuple[int, ...]
    policies: tuple[str, ...] = DEFAULT_POLICIES
    expert_bytes: tuple[int, ...] | None = None  # one expert of each MoE layer


def parse_policies(text: str) -> tuple[str, ...]:
    """``lru,arc,static:FILE,belady`` → names; ValueError naming what is allowed."""
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    if not names:
        raise ConfigError(f"--policies is empty; choose from {', '.join(POLICIES)} (static:FILE for a subset)")
    for name in names:
        if name not in POLICIES and not name.startswith("static:"):
            raise ConfigError(
                f"unknown policy {name!r}; choose from {', '.join(POLICIES)} (static:FILE for a subset file)"
            )
    if len(set(names)) != len(names):
        raise ConfigError(f"--policies names a policy twice: {text}")
    return names


def parse_budgets(text: str) -> tuple[int, ...]:
    """``4,8,16`` → counts of resident experts per layer; ValueError otherwise."""
    try:
        budgets = tuple(int(b) for b in text.split(",") if b.strip())
    except ValueError:
        raise ConfigError(f"--budget must be counts of experts per layer like 4 or 4,8,16, got {text!r}") from None
    if not budgets:
        raise ConfigError("--budget is empty: give counts of experts per layer like 4,8,16")
    return tuple(sorted(set(budgets)))


def check_budgets(budgets: Sequence[int], top_k: int, num_experts: int) -> None:
    for b in budgets:
        if b < top_k:
            raise ConfigError(
                f"budget {b} is below top-k = {top_k}: a token's experts must be resident together; "
                f"give budgets from {top_k} to {num_experts}"
            )
        if b > num_experts:
            raise ConfigError(f"budget {b} exceeds the {num_experts} experts per layer; give {top_k}..{num_experts}")


def static_subsets(spec: str, acc: Accesses, budget: int) -> list[list[int]]:
    """Per-layer pinned experts of ``static`` (oracle top B−k by frequency) or ``static:FILE``."""
    if spec == "static":
        keep = budget - acc.top_k
        counts = np.stack(
            [np.bincount(acc.chosen[:, layer].reshape(-1), minlength=acc.num_experts) for layer in range(acc.layers)]
        )
        order = np.argsort(-counts, axis=1, kind="stable")[:, :keep]
        return [sorted(int(e) for e in row) for row in order]
    subsets = read_subset_file(Path(spec.removeprefix("static:")), acc.num_experts)
    out = []
    for layer in range(acc.layers):
        pinned = subsets.get(layer, [])
        if any(not 0 <= e < acc.num_experts for e in pinned):
            raise ConfigError(f"{spec}: MoE layer {layer} names experts outside 0..{acc.num_experts - 1}")
        if len(pinned) + acc.top_k > budget:
            raise ConfigError(
                f"{spec} pins {len(pinned)} experts at MoE layer {layer} and static keeps top-k = {acc.top_k} "
                f"slots for the others: budget {budget} is too small (give at least {len(pinned) + acc.top_k})"
            )
        out.append(pinned)
    return out


def read_subset_file(path: Path, num_experts: int | None = None) -> dict[int, list[int]]:
    """``{layer: [experts]}`` from a subset file (``subset select --json``, an expert mask, ...), read by
    the reader of every policy file (errors name the file); one that records another expert count
    than ``num_experts`` (the trace's) is refused."""
    from moectl.routing.legacy import check_expert_count, normalise
    from moectl.routing.mask import expert_lists_of
    from moectl.routing.policy_files import read_policy_json

    data = normalise(read_policy_json(path, "subset file"))
    check_expert_count(data, path, None if num_experts is None else [num_experts])
    for form in ("experts", "keep"):
        if isinstance(data.get(form), dict):
            return expert_lists_of(data[form], form)
    raise FileFormatError(f"{path}: static:FILE needs per-layer expert lists ({{'keep': {{layer: [ids]}}}})")


def make_caches(spec: str, acc: Accesses, budget: int) -> list[Cache]:
    """One cache per MoE layer for policy ``spec`` at ``budget``."""
    if spec == "belady":
        return [BeladyCache(budget, acc.num_experts, acc.chosen[:, layer]) for layer in range(acc.layers)]
    if spec == "static" or spec.startswith("static:"):
        return [StaticCache(budget, acc.num_experts, pinned) for pinned in static_subsets(spec, acc, budget)]
    return [ONLINE[spec](budget, acc.num_experts) for _ in range(acc.layers)]


def replay(caches: list[Cache], chosen: np.ndarray) -> np.ndarray:
    """Hits per layer [L] of ``chosen`` [T, L, k] through ``caches`` (layers independent)."""
    hits = np.zeros(len(caches), dtype=np.int64)
    for layer, cache in enumerate(caches):
        step = cache.step
        hits[layer] = sum(map(step, chosen[:, layer].tolist()))
    return hits


def run(config: SimConfig, *, progress: bool = False) -> list[dict]:
    """Result rows (see the module doc), budgets ascending, policies in the order given.

    ``progress``: a bar of the replays, one step per (budget, policy), nothing per token; drawn on
    an interactive terminal only (:func:`moectl.progress.progress_bar`)."""
    from moectl.progress import progress_bar

    check_budgets(config.budgets, config.accesses.top_k, config.accesses.num_experts)
    rows: list[dict] = []
    with progress_bar("replaying {task.fields[now]}", progress) as bar:
        task = bar.add_task("replay", total=len(config.budgets) * len(config.policies), now="")
        for budget in config.budgets:
            bar.update(task, now=f"belady B={budget}")
            start = time.perf_counter()
            belady_hits = replay(make_caches("belady", config.accesses, budget), config.accesses.chosen)
            belady_s = time.perf_counter() - start
            for spec in config.policies:
                bar.update(task, now=f"{spec} B={budget}")
                rows.append(_row(config, spec, budget, belady_hits, belady_s))
                bar.advance(task)
    return rows


def _row(config: SimConfig, spec: str, budget: int, belady_hits: np.ndarray, belady_s: float) -> dict:
    """One policy's result row at one budget (``belady``: the optimum's hits, replayed once)."""
    acc = config.accesses
    per_layer = acc.tokens * acc.top_k
    start = time.perf_counter()
    hits = belady_hits if spec == "belady" else replay(make_caches(spec, acc, budget), acc.chosen)
    seconds = belady_s if spec == "belady" else time.perf_counter() - start
    misses = per_layer - hits
    row = {
        "policy": spec,
        "budget": budget,
        "hit_rate": float(hits.sum() / acc.accesses),
        "hits": int(hits.sum()),
        "misses": int(misses.sum()),
        "misses_per_token": float(misses.sum() / acc.tokens),
        "bytes_per_token": None,
        "gap_to_belady": float((belady_hits.sum() - hits.sum()) / acc.accesses),
        "hit_rate_per_layer": [float(h / per_layer) for h in hits],
        "seconds": seconds,
    }
    if config.expert_bytes is not None:
        row["bytes_per_token"] = float(np.dot(misses, np.asarray(config.expert_bytes)) / acc.tokens)
    return row


def previous_token_overlap(chosen: np.ndarray) -> float | None:
    """Mean fraction of a token's experts that the previous token used too, over tokens and layers:
    the temporal locality every policy lives on (a trace whose tokens share most of their experts
    gives high hit rates to all of them)."""
    if chosen.shape[0] < 2:
        return None
    same = (chosen[1:, :, :, None] == chosen[:-1, :, None, :]).any(-1)  # [T-1, L, k]
    return float(same.mean())


def report(config: SimConfig, rows: list[dict], routing: str) -> dict:
    """The JSON document: the trace's shape, how its routing came about, and the rows."""
    acc = config.accesses
    return {
        "trace": {
            "sources": list(acc.sources),
            "tokens": acc.tokens,
            "layers": acc.layers,
            "top_k": acc.top_k,
            "num_experts": acc.num_experts,
            "accesses": acc.accesses,
            "routing": routing,
            "previous_token_overlap": previous_token_overlap(acc.chosen),
        },
        "expert_bytes": None if config.expert_bytes is None else list(config.expert_bytes),
        "results": rows,
    }
