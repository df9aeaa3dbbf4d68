"""The settings of one τ search (RoE §2.2), as one value: what ``moectl roe tune`` parses into."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from moectl.ensemble.roe_config import AGGREGATIONS, check_k
from moectl.errors import ConfigError
from moectl.runconfig import RunConfig

OBJECTIVES = ("ppl", "acc")


@dataclass
class TuneConfig(RunConfig):
    """A per-layer (or uniform) τ search with Optuna TPE; names as in RoE §2.2.

    ``model``: the model spec (``run_tune`` loads it; ``tune`` on a loaded model records it in the
    profile). ``data``: validation JSONL(.gz). ``K``: routing samples per token. ``objective``:
    ``ppl`` (validation perplexity) or ``acc`` (accuracy). ``trials``: the budget, a resumed study's
    included. ``max_tau``: the bound T of each τ_i (§2.2.2: 0.5); ``skip_layers``: the first and
    last L MoE layers held at τ = 0. ``uniform``: one shared τ swept in ``uniform_step`` steps
    (Appendix B). ``storage``: the study's file (SQLite, or ``.journal`` for several processes);
    ``out``: the profile JSON; ``plot_dir``: the PNGs. ``limit`` (the first N items) and
    ``max_docs`` (N items spread evenly) with ``max_length`` bound a trial's cost.
    """

    kind: ClassVar[str] = "tune config"

    model: str = ""
    data: Path | None = None
    K: int = 16
    objective: Literal["ppl", "acc"] = "ppl"
    trials: int = 50
    max_tau: float = 0.5
    skip_layers: int = 1
    seed: int = 0
    aggregation: str = "prob_mean"
    uniform: bool = False
    uniform_step: float = 0.05
    storage: Path | None = None
    study_name: str | None = None
    out: Path | None = None
    plot_dir: Path | None = None
    batch_size: int = 8
    max_length: int = 256
    limit: int | None = None
    max_docs: int | None = None
    device: str = "cpu"
    dtype: str = "auto"

    def __post_init__(self) -> None:
        for name in ("data", "storage", "out", "plot_dir"):
            if isinstance(getattr(self, name), str):
                setattr(self, name, Path(getattr(self, name)))
        try:
            check_k(self.K, "K (routing samples)")
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if self.objective not in OBJECTIVES:
            raise ConfigError(
                f"objective must be one of {', '.join(OBJECTIVES)} (validation perplexity or accuracy), "
                f"got {self.objective!r}"
            )
        if isinstance(self.trials, bool) or not isinstance(self.trials, int) or self.trials < 1:
            raise ConfigError(f"trials (the tuning budget) must be an integer >= 1, got {self.trials!r}")
        if not (math.isfinite(self.max_tau) and self.max_tau > 0):
            raise ConfigError(
                f"max_tau must be a finite number > 0 (the paper bounds tau to [0, 0.5], RoE §2.2.2), got {self.max_tau}"
            )
        if isinstance(self.skip_layers, bool) or not isinstance(self.skip_layers, int) or self.skip_layers < 0:
            raise ConfigError(
                "skip_layers (first and last L MoE layers held at tau = 0) must be an integer >= 0, "
                f"got {self.skip_layers!r}"
            )
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {self.aggregation!r}")
        if self.uniform and not self.uniform_step > 0:
            raise ConfigError(f"uniform_step must be > 0, got {self.uniform_step}")
        if self.max_docs is not None and (isinstance(self.max_docs, bool) or self.max_docs < 1):
            raise ConfigError(
                f"max_docs (items in the fixed validation slice) must be an integer >= 1, got {self.max_docs!r}"
            )
        for name in ("batch_size", "max_length"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"limit must be >= 1, got {self.limit}")
