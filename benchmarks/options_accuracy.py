"""Accuracy of a routed model on the offline evaluation sets, for the TE-MoE headline (Tables 2–3).

Scored the way ``moectl eval`` scores: the routing comes from ``setup_routing`` (a policy, or a
controller folder as ``moectl eval --controller`` takes it: adapters and trained routers merged,
per-sequence options seeded by ``seed``); multiple-choice sets go through
``evaluate_multiple_choice`` (``--engine moectl``; the items are built once per set and shared
by every method); other sets (lambada_openai: exact match of the last word) through lm-eval's
harness over ``MoectlLM`` (``--engine lm-eval``).

A set enters the comparison when the full model is above chance on it: the Wilson 95% lower
bound of its accuracy on ``screen_limit`` items exceeds chance, taken as the larger of 1/choices
(averaged over the items) and the majority-answer rate (always picking the commonest gold answer
text, which a scorer blind to the question can do: BoolQ's "yes" is ~62%; where every item has
its own answers, as in ARC, it is negligible), or 1/vocabulary for lambada. The metric of each set is fixed
before looking (lm-eval/OLMES usage): length-normalised ``acc_norm`` where the choices are free
text of varying length (ARC, HellaSwag, OpenBookQA, PIQA), ``acc`` elsewhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from torch import nn

from moectl.eval.multiple_choice import MCItem, evaluate_multiple_choice, mc_items
from moectl.eval.policy_file import EvalRouting
from moectl.eval.report import policy_switch_rate

TASKS = ("arc_easy", "piqa", "sciq", "hellaswag", "winogrande", "boolq", "openbookqa", "lambada_openai")
METRIC = {
    "arc_easy": "acc_norm",
    "arc_challenge": "acc_norm",
    "hellaswag": "acc_norm",
    "openbookqa": "acc_norm",
    "piqa": "acc_norm",
}


def metric_of(task: str) -> str:
    return METRIC.get(task, "acc")


@dataclass
class EvalSet:
    """A set's items for the comparison: multiple-choice items (None: scored by the harness)."""

    task: str
    items: list[MCItem] | None


def load_sets(
    tasks: list[str], cache: str | os.PathLike | None, limit: int, seed: int = 1234
) -> dict[str, EvalSet]:
    """The first ``limit`` items of each set (``ValueError`` for an unknown set, before any work)."""
    from moectl.eval.lm_tasks import check_data, resolve_tasks, task_configs

    tasks = resolve_tasks(tasks)
    check_data(tasks, cache)
    configs = task_configs()
    out = {}
    for task in tasks:
        if "group" in configs[task]:
            raise ValueError(f"task {task!r} is a group; give its member sets one by one")
        mc = configs[task].get("output_type") == "multiple_choice"
        out[task] = EvalSet(task, mc_items(task, cache, limit, None, seed) if mc else None)
    return out


def chance(evalset: EvalSet, vocab_size: int) -> dict[str, float]:
    """Chance accuracy of a set: 1/choices (mean over items), the majority-answer rate (the commonest
    gold answer text, counted where that text is one choice of the item), and the larger of the two."""
    if evalset.items is None:
        uniform = 1.0 / vocab_size
        return {"uniform": uniform, "majority": uniform, "chance": uniform}
    items = evalset.items
    uniform = sum(1.0 / len(item.requests) for item in items) / len(items)
    counts: dict[str, int] = {}
    for item in items:
        answers = [continuation for _, continuation in item.requests]
        gold = answers[item.gold]
        if answers.count(gold) == 1:  # an answer text a question-blind preference can pick
            counts[gold] = counts.get(gold, 0) + 1
    majority = max(counts.values(), default=0) / len(items)
    return {"uniform": uniform, "majority": majority, "chance": max(uniform, majority)}


def score_set(
    model: nn.Module,
    tokenizer: Any,
    routing: EvalRouting,
    evalset: EvalSet,
    limit: int,
    cache: str | os.PathLike | None = None,
    batch_size: int = 16,
    max_length: int = 2048,
    seed: int = 1234,
) -> dict[str, Any]:
    """Accuracy of ``model`` under ``routing`` on the first ``limit`` items of ``evalset``:
    ``{metric, value, ci95, n, metrics (every one scored), switch_rate}``; the switch rate (under a
    policy only) is of the policy's own mask ω while scoring, as ``moectl eval`` reports it."""
    switch = bool(routing.policies)
    if evalset.items is not None:
        assert routing.info is not None
        entry = evaluate_multiple_choice(
            model,
            tokenizer,
            evalset.items[:limit],
            routing.plan,
            routing.info,
            batch_size,
            max_length,
            switch,
            False,
            seed,
        )
        entry.pop("per_item")
    else:
        from moectl.eval.forward import SwitchStats
        from moectl.eval.lm_backend import MoectlLM
        from moectl.eval.lm_tasks import run_lm_eval, tasks_from_lm_eval
        from moectl.eval.multiple_choice import switch_summary

        lm = MoectlLM(
            model, tokenizer, routing=routing, batch_size=batch_size, max_length=max_length, seed=seed
        )
        lm.switch = SwitchStats() if switch else None
        entry = tasks_from_lm_eval(run_lm_eval(lm, [evalset.task], cache, limit, None, seed))[evalset.task]
        entry["switch_rate"] = switch_summary(lm.switch, seed)
    name = metric_of(evalset.task)
    if name not in entry["metrics"]:
        raise ValueError(f"{evalset.task}: no {name!r} metric (got {', '.join(entry['metrics'])})")
    return {
        "metric": name,
        "value": entry["metrics"][name]["value"],
        "ci95": entry["metrics"][name]["ci95"],
        "n": entry["n"],
        "metrics": {k: {"value": m["value"], "ci95": m["ci95"]} for k, m in entry["metrics"].items()},
        "switch_rate": policy_switch_rate(entry.get("switch_rate")),  # the policy's own ω, as reports show
    }


def screen(entry: dict[str, Any], odds: dict[str, float]) -> dict[str, Any]:
    """The full model's screening result on one set: above chance when the 95% lower bound is."""
    low = entry["ci95"][0] if entry["ci95"] is not None else entry["value"]
    return {
        **odds,
        "metric": entry["metric"],
        "value": entry["value"],
        "ci95": entry["ci95"],
        "n": entry["n"],
        "above_chance": bool(low > odds["chance"]),
    }
