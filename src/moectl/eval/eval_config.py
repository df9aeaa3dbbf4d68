"""The settings of one ``moectl eval`` run, as one value: what ``evaluate(config)`` runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from moectl.errors import ConfigError
from moectl.quant.quant_config import check_scheme
from moectl.runconfig import RunConfig

ENGINES = ("lm-eval", "moectl")


@dataclass
class EvalConfig(RunConfig):
    """What to evaluate, under which routing, with which engine.

    ``model``: ``tiny:FAMILY``, a checkpoint folder or a hub id. ``tasks``: task or group names
    (``moectl data list-evals``; a comma string is split); ``perplexity``: a JSONL corpus or corpus
    folder (its ``split``), per ``domain`` too with ``by_domain``. Routing: ``policy`` (any file
    ``moectl.load_policy`` reads, ``option:K``, or policy objects), ``roe`` (a τ profile or
    ``K=16,tau=0.5``: RoE §2), ``controller`` (a folder of ``moectl options train``: TE-MoE).
    ``engine``: ``lm-eval`` (lm-eval's harness over moectl's backend) or ``moectl`` (multiple
    choice in process: the same scores). ``switch`` (None: on with a policy) records the switch
    rate per task. ``cache``: the evaluation sets (default ``$MOECTL_EVALS``).
    ``allow_code_exec`` lets humaneval/mbpp run generated code (else ``$MOECTL_ALLOW_CODE_EXEC=1``).
    ``quantize`` (``int8`` | ``int4``): the experts quantized at load (``moectl.quant``), after a
    controller's adapters are merged.
    """

    kind: ClassVar[str] = "eval config"

    model: str
    tasks: tuple[str, ...] = ()
    perplexity: Path | None = None
    by_domain: bool = False
    split: str = "test"
    limit: int | None = None
    num_fewshot: int | None = None
    max_gen_toks: int | None = None
    policy: Any = None
    roe: str | None = None
    controller: str | None = None
    engine: Literal["lm-eval", "moectl"] = "lm-eval"
    batch_size: int = 8
    max_length: int | None = None
    seed: int = 1234
    switch: bool | None = None
    cache: Path | None = None
    device: str = "cpu"
    dtype: str = "auto"
    label: str | None = None
    allow_code_exec: bool = False
    quantize: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.tasks, str):
            self.tasks = tuple(t.strip() for t in self.tasks.split(",") if t.strip())
        self.tasks = tuple(self.tasks)
        check_scheme(self.quantize)
        if self.engine not in ENGINES:
            raise ConfigError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if not self.tasks and self.perplexity is None:
            raise ConfigError("nothing to evaluate: give --tasks and/or --perplexity CORPUS")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"--limit must be >= 1, got {self.limit}")
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.max_length is not None and self.max_length < 1:
            raise ConfigError(f"--max-length must be >= 1, got {self.max_length}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready settings; policy objects by their type (a file or spec as given)."""
        data = super().to_dict()
        policy = self.policy
        if isinstance(policy, (list, tuple)):
            data["policy"] = [str(p) if isinstance(p, (str, Path)) else type(p).__name__ for p in policy]
        elif not isinstance(policy, (str, Path, type(None))):
            data["policy"] = type(policy).__name__
        return data
