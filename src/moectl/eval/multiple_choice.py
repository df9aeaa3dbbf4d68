"""Multiple choice by log-likelihood, moectl's own scorer (EMO §C: "acc-raw").

Each choice is scored by the summed log-probability of its continuation given the prompt; the
prediction is the highest-scoring choice. Two accuracies, as in lm-eval and OLMES, each reported
where the task's YAML lists it in ``metric_list`` (as lm-eval does; e.g. BoolQ lists ``acc`` only):

- ``acc`` (EMO's *acc-raw*): argmax of the raw summed log-probability;
- ``acc_norm``: argmax of the log-probability divided by the choice's length in characters.

Items come from the same task YAMLs the lm-eval bridge uses (prompts, few-shot examples and
targets built by lm-eval's task code), so the two engines score the same requests; this one runs
in-process, keeps per-item scores, and takes per-request routing plans. Intervals: Wilson.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moectl.adapters.inspect import ModelInfo
from moectl.errors import ConfigError
from moectl.eval.forward import RoutingPlan, SwitchStats
from moectl.eval.intervals import mean_interval, wilson_interval
from moectl.eval.results import metric
from moectl.eval.scoring import score_pairs


@dataclass
class MCItem:
    """One question: a (context, continuation) request per choice, the gold index, choice lengths,
    and the accuracies its task reports (its YAML's ``metric_list``)."""

    requests: list[tuple[str, str]]
    gold: int
    lengths: list[int]
    doc_id: int = 0
    metrics: tuple[str, ...] = ("acc", "acc_norm")


def mc_items(
    task: str,
    cache: str | os.PathLike | None = None,
    limit: int | None = None,
    num_fewshot: int | None = None,
    seed: int = 1234,
) -> list[MCItem]:
    """The items of a multiple-choice task (or group: its leaves, in order) from the shipped YAMLs."""
    from lm_eval.tasks import TaskManager

    from moectl.eval.lm_tasks import check_data, render_tasks, resolve_tasks

    resolve_tasks([task])
    check_data([task], cache)
    items: list[MCItem] = []
    with tempfile.TemporaryDirectory(prefix="moectl-tasks-") as tmp:
        manager = TaskManager(include_path=str(render_tasks(cache, Path(tmp))), include_defaults=False)
        for name, obj in manager.load([task])["tasks"].items():
            if obj.get_config("output_type") != "multiple_choice":
                raise ConfigError(f"task {name!r} is {obj.get_config('output_type')}, not multiple_choice")
            if num_fewshot is not None:
                obj.set_config(key="num_fewshot", value=num_fewshot)
            elif obj.get_config("num_fewshot") is None:
                obj.set_config(key="num_fewshot", value=0)
            obj.set_fewshot_seed(seed=seed)
            obj.build_all_requests(limit=limit)
            items.extend(_items_of(obj))
    return items


def _items_of(task: Any) -> list[MCItem]:
    by_doc: dict[int, list[Any]] = {}
    for inst in task.instances:
        by_doc.setdefault(inst.doc_id, []).append(inst)
    listed = [m.get("metric") for m in (task.config.metric_list or []) if isinstance(m, dict)]
    metrics = tuple(m for m in ("acc", "acc_norm") if m in listed) or ("acc",)
    items = []
    for doc_id, instances in sorted(by_doc.items()):
        instances.sort(key=lambda inst: inst.idx)
        doc = instances[0].doc
        choices = task.doc_to_choice(doc)
        gold = task.doc_to_text(doc) if task.multiple_input else task.doc_to_target(doc)
        if isinstance(gold, str):
            gold = choices.index(gold)
        items.append(
            MCItem(
                [tuple(inst.arguments[:2]) for inst in instances],
                int(gold),
                [len(c) for c in choices],
                doc_id,
                metrics,
            )
        )
    return items


def evaluate_multiple_choice(
    model: nn.Module,
    tokenizer: Any,
    items: Sequence[MCItem],
    plan: RoutingPlan,
    info: ModelInfo,
    batch_size: int = 8,
    max_length: int = 2048,
    switch: bool = False,
    progress: bool = True,
    seed: int = 1234,
    description: str = "choices",
) -> dict[str, Any]:
    """Score ``items``; returns a task entry of the results schema (``acc``, ``acc_norm``);
    ``description``: the progress bar's label."""
    if not items:
        raise ConfigError("no multiple-choice items to evaluate")
    pairs = [pair for item in items for pair in item.requests]
    stats = SwitchStats() if switch else None
    scored = score_pairs(
        model, tokenizer, pairs, plan, info, batch_size, max_length, stats, progress, description
    )
    width = max(len(item.requests) for item in items)
    raw = torch.full((len(items), width), float("-inf"), dtype=torch.float64)
    norm = raw.clone()
    counts = torch.tensor([len(item.requests) for item in items])
    offsets = torch.cumsum(counts, 0) - counts
    rows = torch.repeat_interleave(torch.arange(len(items)), counts)
    cols = torch.arange(len(pairs)) - offsets[rows]
    lengths = torch.tensor(
        [n for item in items for n in item.lengths[: len(item.requests)]], dtype=torch.float64
    )
    raw[rows, cols] = scored.logprob
    norm[rows, cols] = scored.logprob / lengths.clamp(min=1)
    gold = torch.tensor([item.gold for item in items])
    n = len(items)
    correct = {"acc": raw.argmax(1) == gold, "acc_norm": norm.argmax(1) == gold}
    reported = dict.fromkeys(name for item in items for name in item.metrics)  # in order, once
    metrics = {}
    for name in reported:
        hits = correct[name]
        k = int(hits.sum())
        metrics[name] = metric(k / n, wilson_interval(k, n), "wilson")
    entry = {
        "kind": "multiple_choice",
        "n": n,
        "split": None,
        "primary": "acc",
        "metrics": metrics,
        "switch_rate": switch_summary(stats, seed),
        "per_item": {"acc": correct["acc"].tolist(), "logprobs": raw.tolist()},
    }
    return entry


def switch_summary(stats: SwitchStats | None, seed: int = 1234) -> dict[str, Any] | None:
    """The results-schema ``switch_rate`` block of accumulated stats (None when none measured)."""
    if stats is None:
        return None
    summary = stats.summary()
    values = summary.pop("per_sequence")
    if summary["mean"] is None:
        return None
    ci = mean_interval(values, seed=seed) if len(values) > 1 else None
    return {**summary, "ci95": None if ci is None else list(ci), "k_hat": stats.k_hat, "region": None}
