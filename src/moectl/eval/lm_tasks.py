"""Run lm-eval tasks over the converted sets: render the shipped YAMLs, check data, evaluate.

The YAMLs in ``moectl/eval/tasks/`` name their data files as ``@EVALS@/SET/SPLIT.jsonl``. Each run
copies them (and ``utils.py``) into a temporary directory with ``@EVALS@`` replaced by the cache
path and builds an lm-eval ``TaskManager`` over that directory only (lm-eval's ~10k built-in
tasks are not indexed). Missing data is reported before lm-eval starts, with the fetch command.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from moectl.errors import ConfigError
from moectl.eval.intervals import wilson_interval
from moectl.eval.results import metric
from moectl.eval.set_cache import EvalSetMissingError, evals_dir, refetch_hint, split_path

TASK_DIR = Path(__file__).parent / "tasks"
_PLACEHOLDER = "@EVALS@"
_DATA_REF = re.compile(r"@EVALS@/([A-Za-z0-9_]+)/(?:by_category/[A-Za-z0-9_]+/)?([A-Za-z0-9_]+)\.jsonl")
# metrics that are a mean of 0/1 per item: Wilson intervals apply
BINARY_METRICS = ("acc", "acc_norm", "exact_match", "exact_match_flexible", "pass_at_1")
_PRIMARY = ("acc", "exact_match", "perplexity", "pass_at_1")


class _Loader(yaml.SafeLoader):
    """Reads task YAMLs, keeping ``!function`` references as strings."""


_Loader.add_constructor("!function", lambda loader, node: f"!function {loader.construct_scalar(node)}")


def task_configs() -> dict[str, dict[str, Any]]:
    """``{name: parsed YAML}`` for every shipped task and group."""
    out = {}
    for path in sorted(TASK_DIR.glob("*.yaml")):
        config = yaml.load(path.read_text(), Loader=_Loader)
        out[config.get("task") if isinstance(config.get("task"), str) else config["group"]] = config
    return out


def available_tasks() -> list[str]:
    """Names accepted by ``--tasks`` (tasks and groups)."""
    return sorted(task_configs())


def _leaves(name: str, configs: dict[str, dict[str, Any]]) -> list[str]:
    config = configs[name]
    if "group" in config:
        return [leaf for sub in config["task"] for leaf in _leaves(sub, configs)]
    return [name]


def resolve_tasks(names: Sequence[str]) -> list[str]:
    """Validate task names (``ValueError`` listing the valid ones)."""
    configs = task_configs()
    unknown = [n for n in names if n not in configs]
    if unknown or not names:
        raise ConfigError(
            f"unknown task(s) {', '.join(unknown) or '(none given)'}; available: {', '.join(sorted(configs))}"
        )
    return list(dict.fromkeys(names))


def check_data(names: Sequence[str], cache: str | os.PathLike | None = None) -> None:
    """Raise ``EvalSetMissingError`` (saying how to fetch) if any file a task reads is absent."""
    configs = task_configs()
    for name in resolve_tasks(names):
        for leaf in _leaves(name, configs):
            text = (TASK_DIR / f"{leaf}.yaml").read_text()
            for set_name, split in _DATA_REF.findall(text):
                path = split_path(set_name, split, cache)  # raises with the fetch command
                rendered = text.replace(_PLACEHOLDER, str(evals_dir(cache)))
                for ref in re.findall(r'"([^"]+\.jsonl)"', rendered):
                    if not Path(ref).exists():
                        raise EvalSetMissingError(
                            f"task {leaf!r} reads {ref}, which is missing next to {path}: "
                            f"{refetch_hint(set_name)}"
                        )


def render_tasks(cache: str | os.PathLike | None, dest: Path) -> Path:
    """Copy the task YAMLs into ``dest`` with the data paths filled in."""
    root = str(evals_dir(cache).resolve())
    dest.mkdir(parents=True, exist_ok=True)
    for path in TASK_DIR.glob("*.yaml"):
        (dest / path.name).write_text(path.read_text().replace(_PLACEHOLDER, root))
    shutil.copy(TASK_DIR / "utils.py", dest / "utils.py")
    return dest


@contextmanager
def hub_offline() -> Iterator[None]:
    """The hub off for the block only: the task data is local, so lm-eval must not ask the hub.

    ``HF_HUB_OFFLINE=1`` and ``HF_DATASETS_OFFLINE=1`` in the environment, and the constants
    ``huggingface_hub`` and ``datasets`` read from it at their import; all put back after, so
    loading a hub model or data set later in the process still works."""
    constants = _optional("huggingface_hub.constants")
    datasets_config = _optional("datasets.config")  # imported now: its constants are the user's
    env = {name: os.environ.get(name) for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    flags = [
        (module, name, getattr(module, name))
        for module, name in (
            (constants, "HF_HUB_OFFLINE"),
            (datasets_config, "HF_HUB_OFFLINE"),
            (datasets_config, "HF_DATASETS_OFFLINE"),
        )
        if module is not None and hasattr(module, name)
    ]
    os.environ.update(dict.fromkeys(env, "1"))
    for module, name, _ in flags:
        setattr(module, name, True)
    try:
        yield
    finally:
        for name, value in env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        for module, name, value in flags:
            setattr(module, name, value)


def _optional(name: str) -> Any:
    """The module ``name``, or None where it is not installed."""
    try:
        return importlib.import_module(name)
    except ImportError:  # pragma: no cover - dependencies of transformers and lm-eval
        return None


def run_lm_eval(
    lm: Any,
    tasks: Sequence[str],
    cache: str | os.PathLike | None = None,
    limit: int | None = None,
    num_fewshot: int | None = None,
    seed: int = 1234,
    bootstrap_iters: int = 1000,
    log_samples: bool = False,
    gen_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Evaluate ``lm`` (an lm-eval ``LM``, e.g. :class:`moectl.eval.lm_backend.MoectlLM`) on ``tasks``.

    Returns lm-eval's raw output. Seeds are fixed (python, numpy, torch, few-shot sampling).
    ``gen_kwargs`` override the generation settings of generative tasks (e.g. ``max_gen_toks``).
    """
    names = resolve_tasks(tasks)
    check_data(names, cache)
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    with tempfile.TemporaryDirectory(prefix="moectl-tasks-") as tmp, hub_offline():
        manager = TaskManager(include_path=str(render_tasks(cache, Path(tmp))), include_defaults=False)
        return simple_evaluate(
            model=lm,
            tasks=names,
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=manager,
            bootstrap_iters=bootstrap_iters,
            log_samples=log_samples,
            gen_kwargs=gen_kwargs,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
        )


def _kind(config: dict[str, Any]) -> str:
    return {"multiple_choice": "multiple_choice", "generate_until": "generate"}.get(
        config.get("output_type", ""), "loglikelihood"
    )


def tasks_from_lm_eval(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Convert lm-eval's results into the ``tasks`` block of the results schema.

    Binary metrics get Wilson intervals from the item count; others ±1.96 × lm-eval's standard
    error. Groups (mc9, mmlu, mmlu_emo) are included with their aggregate ``acc``.
    """
    configs = task_configs()
    out: dict[str, dict[str, Any]] = {}
    n_samples = raw.get("n-samples", {})
    higher = raw.get("higher_is_better", {})
    for name, values in raw["results"].items():
        config = configs.get(name, {})
        is_group = "group" in config
        leaves = _leaves(name, configs) if name in configs else [name]
        n = sum(int(n_samples.get(leaf, {}).get("effective", 0)) for leaf in leaves)
        metrics: dict[str, Any] = {}
        for key, value in values.items():
            if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            mname, flt = key.split(",", 1)
            label = mname if flt == "none" else f"{mname}[{flt}]"
            better = bool(higher.get(name, {}).get(mname, mname != "perplexity"))
            stderr = values.get(f"{mname}_stderr,{flt}")
            if mname in BINARY_METRICS and n > 0 and not is_group:
                successes = round(float(value) * n)
                metrics[label] = metric(value, wilson_interval(successes, n), "wilson", better)
            elif isinstance(stderr, (int, float)):
                metrics[label] = metric(
                    value, (value - 1.96 * stderr, value + 1.96 * stderr), "normal", better
                )
            else:
                metrics[label] = metric(value, None, "none", better)
        if not metrics:
            continue
        primary = next((p for p in _PRIMARY if p in metrics), sorted(metrics)[0])
        kinds = {_kind(configs[leaf]) for leaf in leaves if leaf in configs}
        split = None if is_group else (config.get("test_split") or config.get("validation_split"))
        out[name] = {
            "kind": kinds.pop() if len(kinds) == 1 else "multiple_choice",
            "n": n,
            "split": split,
            "primary": primary,
            "metrics": metrics,
            "switch_rate": None,
        }
    return out
