"""``moectl options train`` as a function: a run's settings as one value, and :func:`run_train`.

    from moectl.options import OptionsConfig, OptionsRunConfig, run_train
    result = run_train(OptionsRunConfig("tiny:olmoe", "runs/ctrl", OptionsConfig(k_hat=4, steps=20)))

The command only parses its flags into an :class:`OptionsRunConfig` and calls :func:`run_train`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from moectl.errors import ConfigError
from moectl.options.options_config import OptionsConfig
from moectl.runconfig import RunConfig


@dataclass
class OptionsRunConfig(RunConfig):
    """One options training run: the model, where it goes, and the training settings (TE-MoE §4.3).

    ``out``: the run's folder (checkpoints/, final/, log.jsonl, curves.png); with ``resume`` a
    run there continues from its latest checkpoint (refused before any work if ``options``
    differ from the checkpoint's). ``data``: prompts (JSONL or a corpus folder; None: the sample
    corpus). ``eta_from_latency``: set η from the measured expert-load and decode latency at this
    many nats per token of delay (``options/latency.py``) instead of ``options.eta``; such a run
    starts afresh unless ``resume`` finds a checkpoint of the measured η. ``eta_bytes_from_latency``:
    set ``options.eta_per_expert`` (nats per expert a switch brings in) the same way, from one
    expert's measured load time; it cannot be combined with ``eta_from_latency`` or a given
    ``options.eta_per_expert``.
    """

    kind: ClassVar[str] = "options run config"

    model: str
    out: Path
    options: OptionsConfig
    data: Path | None = None
    eta_from_latency: float | None = None
    resume: bool = True
    device: str = "cpu"
    dtype: str = "float32"
    eta_bytes_from_latency: float | None = None

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        if isinstance(self.data, str):
            self.data = Path(self.data)
        check_costs(self.options, self.eta_from_latency, self.eta_bytes_from_latency)


def check_costs(
    options: OptionsConfig, eta_from_latency: float | None, eta_bytes_from_latency: float | None
) -> None:
    """``ConfigError`` unless at most one of the deliberation costs that replace ``options.eta`` is
    given, and a measured one's rate is >= 0 (before the model is loaded)."""
    given = {
        "eta_from_latency (--eta-from-latency)": eta_from_latency,
        "eta_bytes_from_latency (--eta-bytes-from-latency)": eta_bytes_from_latency,
        "eta_per_expert (--eta-per-expert)": options.eta_per_expert,
    }
    named = [name for name, value in given.items() if value is not None]
    if len(named) > 1:
        raise ConfigError(f"{' and '.join(named)} each set the deliberation cost: give one of them")
    for name, value in given.items():
        if value is not None and value < 0:
            raise ConfigError(f"bad deliberation cost: {name} must be >= 0 (nats per token of delay), got {value}")


def run_train(config: OptionsRunConfig, *, progress: bool = True) -> dict[str, Any]:
    """Load the model, read the prompts, (measure η,) and train (:func:`~moectl.options.trainer.train_options`).

    Every check that needs no model comes first: a batch that the launched processes do not
    divide, or a checkpoint in ``out`` of other settings, costs nothing. Returns
    ``train_options``'s result plus ``options`` (the settings trained with, η as measured) and
    ``latency`` (the measurement, or None).
    """
    from moectl.distributed import check_divides, launched_world_size, process_device, ranks
    from moectl.models.load import load_model
    from moectl.options.prompt_data import read_prompts
    from moectl.options.trainer import check_resume, train_options

    options = config.options
    check_divides(options.batch_size, launched_world_size(), "prompts per step")
    measured = config.eta_from_latency is not None or config.eta_bytes_from_latency is not None
    if config.resume and not measured:
        check_resume(config.out, options)
    processes = ranks()
    prompts = read_prompts(config.data)
    device = process_device(config.device, processes) if launched_world_size() > 1 else config.device
    model, tokenizer = load_model(config.model, dtype=config.dtype, device=device, seed=options.seed)
    latency = None
    if config.eta_from_latency is not None:
        from moectl.adapters.inspect import inspect
        from moectl.options.latency import measure_switch_cost

        latency = measure_switch_cost(model, inspect(model), options.k_hat, config.eta_from_latency)
        options = options.with_(eta=processes.broadcast_object(latency["eta"]))  # one η for every process
    if config.eta_bytes_from_latency is not None:
        from moectl.adapters.inspect import inspect
        from moectl.options.latency import measure_expert_cost

        latency = measure_expert_cost(model, inspect(model), config.eta_bytes_from_latency)
        per_expert = processes.broadcast_object(latency["eta_per_expert"])  # one cost for every process
        options = options.with_(eta_per_expert=per_expert)
    result = train_options(
        model, tokenizer, prompts, options, config.out, resume=config.resume, progress=progress, processes=processes
    )
    return {**result, "options": options.to_dict(), "latency": latency}
