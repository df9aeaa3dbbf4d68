"""Per-layer Gumbel temperature tuning with Optuna TPE (RoE §2.2, Appendix A Table 1, B, C).

The search space is τ = {τ_i}, i ∈ L_MoE (§2.2), pruned by the paper's two heuristics (§2.2.2):

1. RoE on the middle layers only — the first and last ``skip_layers`` (L) MoE layers keep τ = 0;
2. a bounded range — every other τ_i ∈ [0, ``max_tau``] (the paper: 0.5; T in Table 1).

The objective (§2.2.1) is validation perplexity (cheap: ``score``'s two-forward parallel path) or
validation accuracy (multiple choice by log-likelihood, or exact match of greedy generations).
The optimiser is TPE (§2.2.2) with a seeded sampler; with ``storage`` (an SQLite file, or a
``.journal`` file: Optuna's ``JournalFileBackend``) the study persists and a rerun continues it up
to the trial budget. Under ``accelerate launch`` the N processes share one study through the file
(a journal by default: safe for concurrent writers), each with its own sampler seed and its part of
the remaining trials, so N trials run at a time; rank 0 writes the profile. The first trial is τ = 0 everywhere
(the plain model), so the tuned profile is never worse than the baseline *on validation*.
Every trial uses the same noise seed (common random numbers), so trials differ only in τ.

``uniform=True`` instead sweeps one shared τ over every MoE layer in steps of ``uniform_step``
(Appendix B: "a uniform temperature across all MoE layers ... in increments of 0.05"), with an
Optuna grid sampler so it is resumable too.

Results: a JSON profile (``config.save_profile``; ``RoEConfig.from_profile`` reads it) and PNGs —
the tuned τ heatmap (Figure 10 layout; rows are the best trials) and, for ``uniform``, the curve.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from moectl.adapters.inspect import ModelInfo, inspect
from moectl.distributed import Ranks, launched_world_size, process_device, ranks
from moectl.ensemble.roe_config import RoEConfig, save_profile
from moectl.errors import ConfigError
from moectl.extras import optional_import
from moectl.io.atomic import crash_point
from moectl.progress import progress_bar
from moectl.roe.score import score
from moectl.roe.score_data import Item, item_kind, load_items
from moectl.roe.tune_config import OBJECTIVES, TuneConfig

__all__ = ["OBJECTIVES", "TuneConfig", "TuneResult", "check_tuning", "run", "tune"]


@dataclass
class TuneResult:
    """The best τ per MoE layer and how it was found."""

    tau: list[float]
    value: float
    baseline: float | None
    objective: str
    trials: int
    history: list[dict] = field(default_factory=list)
    profile: Path | None = None
    figures: list[Path] = field(default_factory=list)
    seconds: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)


def check_tuning(
    num_moe_layers: int, K: int, objective: str, trials: int, max_tau: float, skip_layers: int, uniform: bool
) -> list[int]:
    """Validate tuning arguments (:class:`TuneConfig`'s checks); return the MoE layers whose τ is searched."""
    TuneConfig(K=K, objective=objective, trials=trials, max_tau=max_tau, skip_layers=skip_layers, uniform=uniform)  # type: ignore[arg-type]
    return tuned_layers(num_moe_layers, skip_layers, uniform)


def tuned_layers(num_moe_layers: int, skip_layers: int, uniform: bool) -> list[int]:
    """The MoE layers whose τ is searched: all with ``uniform``, else all but the first and last
    ``skip_layers`` (RoE §2.2.2); ``ConfigError`` when that leaves none."""
    if uniform:
        return list(range(num_moe_layers))
    tuned = list(range(skip_layers, num_moe_layers - skip_layers))
    if not tuned:
        raise ConfigError(
            f"skip_layers={skip_layers} holds the first and last {skip_layers} MoE layers at tau = 0, which leaves "
            f"none of the model's {num_moe_layers} MoE layers to tune; use skip_layers <= {(num_moe_layers - 1) // 2}"
        )
    return tuned


def spread(items: list, n: int) -> list:
    """``n`` items evenly spaced over ``items`` (first and last included; all of them if fewer)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"max_docs (items in the fixed validation slice) must be an integer >= 1, got {n!r}")
    if n >= len(items):
        return list(items)
    return [items[round(i * (len(items) - 1) / max(n - 1, 1))] for i in range(n)]


def _evaluator(model, tokenizer, items, objective, K, aggregation, seed, batch_size, max_length, info):
    kind = item_kind(items)
    if objective == "ppl" and kind not in ("lm", "choice"):
        raise ConfigError(
            "objective ppl needs language-modelling items ({'text'} or {'prompt', 'continuation'})"
        )
    if objective == "acc" and kind not in ("choice", "gen"):
        raise ConfigError(
            "objective acc needs multiple-choice items ({'context', 'choices', 'answer'}) or {'prompt', 'answer'}"
        )

    def evaluate(tau: list[float]) -> float:
        config = RoEConfig(K=K, tau=tau, aggregation=aggregation, seed=seed)
        result = score(
            model, tokenizer, items, config, batch_size=batch_size, max_length=max_length, info=info
        )
        return result.ppl if objective == "ppl" else float(result.accuracy or 0.0)

    return evaluate


def run(config: TuneConfig, *, progress: bool = True) -> TuneResult:
    """``moectl roe tune`` as a function: load ``config.model``, tune on ``config.data``.

    As the verb, a study with no ``storage`` is kept next to ``out`` (``PROFILE.optuna.db``, or
    ``.optuna.journal`` under ``accelerate launch``: one study for every process) so a rerun
    resumes it, and the PNGs go beside ``out`` unless ``plot_dir`` says otherwise.
    """
    from moectl.models.load import load_model

    if not config.model:
        raise ConfigError("give the model to tune (TuneConfig.model: tiny:FAMILY, a checkpoint folder or hub id)")
    if config.data is None:
        raise ConfigError("give --data FILE.jsonl (validation items)")
    if config.out is not None:
        several = ranks().distributed
        config = config.with_(
            storage=config.storage or config.out.with_suffix(".optuna.journal" if several else ".optuna.db"),
            plot_dir=config.plot_dir or config.out.parent,
        )
    device = config.device
    if launched_world_size() > 1:
        device = process_device(device, ranks())
    model, tokenizer = load_model(config.model, dtype=config.dtype, device=device, seed=0)
    return tune(model, tokenizer, config.data, config, progress=progress)


def tune(
    model: nn.Module,
    tokenizer,
    data: str | Path | Sequence[Item] | None = None,
    config: TuneConfig | None = None,
    *,
    progress: bool = True,
    info: ModelInfo | None = None,
    processes: Ranks | None = None,
    model_name: str | None = None,
    **settings: Any,
) -> TuneResult:
    """Tune per-layer τ (or one uniform τ) for RoE on a loaded model; see the module docstring.

    ``config`` (a :class:`TuneConfig`), or its settings as keywords (``K=4, trials=20, ...``; over
    ``config``'s when both are given). ``data``: items, or a JSONL file (default ``config.data``).
    ``max_docs``: score a fixed slice of that many items spread evenly over the data (every domain
    of a domain-ordered split, unlike ``limit``'s first N), the same slice in every trial; with
    ``max_length`` it bounds a trial's cost (``max_docs`` × ``max_length`` tokens × K).
    ``model_name`` (``config.model``) is recorded in the profile."""
    optuna = optional_import("optuna", "moectl.roe.tune")

    if model_name is not None:
        settings["model"] = model_name
    c = config = (config or TuneConfig()).with_(**settings)  # keywords over config's settings, checked
    K, objective, max_tau, skip_layers, seed, uniform = c.K, c.objective, c.max_tau, c.skip_layers, c.seed, c.uniform
    storage, out, plot_dir, limit, max_docs, max_length = c.storage, c.out, c.plot_dir, c.limit, c.max_docs, c.max_length
    data = c.data if data is None else data
    if data is None:
        raise ConfigError("give the validation data (--data FILE.jsonl, or items)")
    info = info or inspect(model)
    n = info.num_moe_layers
    tuned = tuned_layers(n, skip_layers, uniform)
    items = load_items(data, limit) if isinstance(data, (str, Path)) else list(data)[:limit]
    items = spread(items, max_docs) if max_docs is not None else items
    evaluate = _evaluator(
        model, tokenizer, items, objective, K, c.aggregation, seed, c.batch_size, max_length, info
    )
    direction = "minimize" if objective == "ppl" else "maximize"
    mode = "uniform" if uniform else "per-layer"
    name = c.study_name or f"roe-{info.family}-K{K}-{objective}-{mode}"
    processes = processes if processes is not None else ranks()
    if processes.distributed and storage is None:
        raise ConfigError(
            f"{processes.world} processes share one study through a file: give storage "
            "(--storage, e.g. study.journal)"
        )
    url = study_storage(storage)
    optuna.logging.set_verbosity(logging.WARNING)
    grid = [round(i * c.uniform_step, 6) for i in range(int(max_tau / c.uniform_step + 1e-9) + 1)]
    budget = len(grid) if uniform else c.trials
    if processes.is_main:  # one process creates the study (and enqueues τ = 0), then the others join
        study = optuna.create_study(storage=url, study_name=name, direction=direction, load_if_exists=True)
        if not uniform and not study.trials:
            study.enqueue_trial({f"tau_{i}": 0.0 for i in tuned})  # the plain model first
    processes.barrier()
    if not processes.is_main:
        study = optuna.load_study(storage=url, study_name=name)
    done_before = sum(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
    processes.barrier()  # every process counted before any starts a trial
    # a resumed study reseeds with the trials already done, so it does not replay the same draws;
    # each process its own seed, so parallel samplers do not propose the same τ
    seed_now = seed + done_before + 7919 * processes.rank
    if uniform:
        study.sampler = optuna.samplers.GridSampler({"tau": grid}, seed=seed_now)
    else:
        study.sampler = optuna.samplers.TPESampler(seed=seed_now, multivariate=True)

    def tau_of(params: dict) -> list[float]:
        if uniform:
            return [float(params["tau"])] * n
        taus = [0.0] * n
        for i in tuned:
            taus[i] = float(params[f"tau_{i}"])
        return taus

    def objective_fn(trial) -> float:
        if uniform:
            params = {"tau": trial.suggest_categorical("tau", grid)}
        else:
            params = {f"tau_{i}": trial.suggest_float(f"tau_{i}", 0.0, max_tau) for i in tuned}
        return evaluate(tau_of(params))

    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    part = processes.part(max(0, budget - len(done)))  # this process's share of the trials left
    remaining = part.stop - part.start
    start = time.perf_counter()
    enabled = progress and processes.is_main
    with progress_bar("tuning {task.fields[label]}", enabled, suffix="best {task.fields[best]}") as bar:
        best = f"{study.best_value:.4g}" if done else "-"
        task = bar.add_task(
            "tune", total=budget, completed=len(done), label=f"{mode} K={K} {objective}", best=best
        )

        def tick(study, trial) -> None:
            bar.update(task, advance=1, best=f"{study.best_value:.4g}")
            crash_point(f"trial {trial.number} stored")  # the crash tests kill between trials too

        if remaining:
            with quiet_interrupted_trial():
                study.optimize(objective_fn, n_trials=remaining, callbacks=[tick])
    processes.barrier()  # every process's trials are in the study
    seconds = time.perf_counter() - start
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    history = [
        {"trial": t.number, "value": float(t.value), "tau": tau_of(t.params),
         "seconds": t.duration.total_seconds() if t.duration is not None else None}
        for t in complete
    ]  # fmt: skip
    best_trial = study.best_trial
    best_tau = tau_of(best_trial.params)
    zero = [h["value"] for h in history if all(x == 0 for x in h["tau"])]
    result = TuneResult(
        tau=best_tau,
        value=float(best_trial.value),
        baseline=zero[0] if zero else None,
        objective=objective,
        trials=len(complete),
        history=history,
        seconds=seconds,
        info={
            "study": name,
            "storage": str(storage) if storage else None,
            "mode": mode,
            "moe_layers": [layer.layer_idx for layer in info.layers],
        },
    )
    meta = {
        "K": K,
        "aggregation": c.aggregation,
        "objective": objective,
        "value": result.value,
        "baseline_tau0": result.baseline,
        "mode": mode,
        "trials": result.trials,
        "max_tau": max_tau,
        "skip_layers": 0 if uniform else skip_layers,
        "tuned_layers": tuned,
        "seed": seed,
        "model": c.model,
        "family": info.family,
        "moe_layers": [layer.layer_idx for layer in info.layers],
        "study": name,
        "storage": str(storage) if storage else None,
        "validation_items": len(items),
        "validation_slice": {"limit": limit, "max_docs": max_docs, "max_length": max_length},
        "history": history,
    }
    if out is not None and processes.is_main:
        result.profile = save_profile(out, best_tau, **meta)
    if plot_dir is not None and processes.is_main:
        from moectl.reporting.roe_plots import tune_figures  # matplotlib only when plotting

        result.figures = tune_figures(result, Path(plot_dir), max_tau, uniform, direction)
    return result


def study_storage(storage: str | Path | None) -> Any:
    """Optuna storage for a file: a ``.journal`` (or ``.log``) file is a ``JournalStorage`` over
    ``JournalFileBackend`` (concurrent writers from several processes), anything else SQLite."""
    if storage is None:
        return None
    path = Path(storage)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix in (".journal", ".log"):
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        return JournalStorage(JournalFileBackend(str(path)))
    return f"sqlite:///{path.resolve()}"


class _InterruptedTrialFilter(logging.Filter):
    """Drops Optuna's report of a trial that Ctrl-C cut short: a traceback through the model's forward
    (35-51 lines) and "failed with value None". The command says in one line what was kept."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        if (
            record.exc_info
            and record.exc_info[0] is not None
            and issubclass(record.exc_info[0], KeyboardInterrupt)
        ):
            self.seen = True
            return False
        return not (self.seen and "failed with value" in record.getMessage())


@contextmanager
def quiet_interrupted_trial() -> Iterator[None]:
    """Within the block, Optuna's log leaves out the trial a Ctrl-C interrupted (the interrupt itself
    propagates: the study keeps every finished trial, and a rerun resumes it)."""
    import optuna  # noqa: F401 - sets up the "optuna" logger and its handler

    handlers = list(logging.getLogger("optuna").handlers)  # records of optuna.* loggers end here
    quiet = _InterruptedTrialFilter()
    for handler in handlers:
        handler.addFilter(quiet)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(quiet)
