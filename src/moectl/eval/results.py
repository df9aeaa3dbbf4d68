"""One JSON schema for every evaluation result moectl writes (``moectl eval --out``).

A results file is one run: one model, one routing configuration, several tasks::

    {
      "schema": "moectl.eval.results/1",
      "created": "2026-01-01T12:00:00+00:00",          # UTC, ISO 8601
      "model": {"spec": "tiny:olmoe", "family": "olmoe", "num_experts": 8, "top_k": 2,
                "moe_layers": 3, "label": "tiny:olmoe"},   # label: the row name in reports
      "routing": {"label": "full", "policy_file": null, "policies": [],   # what was active
                  "experts_allowed": null,              # mean allowed experts per MoE layer (masks)
                  "roe": null, "controller": null},
      "engine": {"name": "lm-eval", "version": "0.4.13"},   # or {"name": "moectl", ...}
      "settings": {"limit": 200, "num_fewshot": null, "batch_size": 8, "seed": 1234},
      "tasks": {
        "arc_easy": {
          "kind": "multiple_choice",                  # | generate | loglikelihood | perplexity
          "n": 200,                                   # items scored
          "split": "test",
          "primary": "acc",                           # the metric reports show
          "metrics": {
            "acc": {"value": 0.52, "ci95": [0.45, 0.59], "ci_method": "wilson",
                    "higher_is_better": true},
            "acc_norm": {...}
          },
          "switch_rate": {"mean": 0.31, "ci95": [0.29, 0.33], "sequences": 800,
                          "allowed_mean": null, "k_hat": 2, "region": "all"}   # or null
        },
        "perplexity/code": {"kind": "perplexity", "n": 120, "primary": "perplexity",
                            "metrics": {"perplexity": {"value": 12.3, "ci95": [11.9, 12.8],
                                        "ci_method": "bootstrap", "higher_is_better": false},
                                        "tokens": {"value": 51234, "ci95": null, ...}}}
      }
    }

``ci_method`` is ``wilson`` (binomial accuracies), ``bootstrap`` (seeded, resampling items or
documents), ``normal`` (±1.96 × the harness's standard error, for other harness metrics) or
``none``. Accuracies are fractions in [0, 1]; reports print them as percentages.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from moectl.errors import ConfigError, MoectlError, MoectlFileError
from moectl.io.atomic import write_text_atomic

SCHEMA = "moectl.eval.results/1"
CI_METHODS = ("wilson", "bootstrap", "normal", "none")
KINDS = ("multiple_choice", "generate", "loglikelihood", "perplexity")


class ResultsFormatError(MoectlError, ValueError):
    """A results file does not follow the schema; the message names the offending field."""


def metric(
    value: float, ci95: tuple[float, float] | None, method: str, higher_is_better: bool = True
) -> dict[str, Any]:
    """One metric entry."""
    if method not in CI_METHODS:
        raise ConfigError(f"ci_method must be one of {CI_METHODS}, got {method!r}")
    return {
        "value": float(value),
        "ci95": None if ci95 is None else [float(ci95[0]), float(ci95[1])],
        "ci_method": method if ci95 is not None else "none",
        "higher_is_better": bool(higher_is_better),
    }


def new_results(
    model: dict[str, Any], routing: dict[str, Any], engine: dict[str, Any], settings: dict[str, Any]
) -> dict[str, Any]:
    """An empty results document (fill ``tasks``)."""
    return {
        "schema": SCHEMA,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": model,
        "routing": routing,
        "engine": engine,
        "settings": settings,
        "tasks": {},
    }


def validate(doc: Any, where: str = "results") -> dict[str, Any]:
    """Check ``doc`` against the schema; return it or raise ``ResultsFormatError``."""

    def fail(msg: str) -> None:
        raise ResultsFormatError(f"{where}: {msg}")

    if not isinstance(doc, dict):
        fail(f"expected a JSON object, got {type(doc).__name__}")
    if doc.get("schema") != SCHEMA:
        fail(f"'schema' is {doc.get('schema')!r}; this moectl reads {SCHEMA!r}")
    for key in ("model", "routing", "engine", "settings", "tasks"):
        if not isinstance(doc.get(key), dict):
            fail(f"'{key}' must be an object")
    if not isinstance(doc["model"].get("spec"), str):
        fail("'model.spec' must be a string")
    for name, task in doc["tasks"].items():
        if not isinstance(task, dict):
            fail(f"task {name!r} must be an object")
        if task.get("kind") not in KINDS:
            fail(f"task {name!r}: 'kind' must be one of {KINDS}, got {task.get('kind')!r}")
        metrics = task.get("metrics")
        if not isinstance(metrics, dict) or not metrics:
            fail(f"task {name!r}: 'metrics' must be a non-empty object")
        if task.get("primary") not in metrics:
            fail(
                f"task {name!r}: 'primary' {task.get('primary')!r} is not one of its metrics {sorted(metrics)}"
            )
        for mname, m in metrics.items():
            if not isinstance(m, dict) or not isinstance(m.get("value"), (int, float)):
                fail(f"task {name!r}, metric {mname!r}: needs a numeric 'value'")
            ci = m.get("ci95")
            if ci is not None and not (isinstance(ci, list) and len(ci) == 2):
                fail(f"task {name!r}, metric {mname!r}: 'ci95' must be [low, high] or null")
            if m.get("ci_method") not in CI_METHODS:
                fail(f"task {name!r}, metric {mname!r}: 'ci_method' must be one of {CI_METHODS}")
    return doc


def save_results(doc: dict[str, Any], path: str | os.PathLike) -> Path:
    """Validate and write atomically."""
    validate(doc)
    return write_text_atomic(path, json.dumps(doc, indent=2) + "\n")


def load_results(path: str | os.PathLike) -> dict[str, Any]:
    """Read and validate a results file."""
    path = Path(path)
    if not path.exists():
        raise MoectlFileError(f"results file {path} does not exist")
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ResultsFormatError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from err
    return validate(doc, where=str(path))
