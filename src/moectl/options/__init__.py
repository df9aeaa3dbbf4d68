"""Temporally extended MoE (TE-MoE): per-layer option controllers with a deliberation cost."""

from moectl.options.baselines import BASELINES, baseline_policy
from moectl.options.controller import ControllerConfig, LayerController, OptionController, build_controller
from moectl.options.option_state import load_controlled
from moectl.options.policy import ControllerPolicy, OptionRecord
from moectl.options.random_options import RandomOptions
from moectl.options.train_run import OptionsRunConfig, run_train
from moectl.options.trainer import OptionsConfig, train_options

__all__ = [
    "BASELINES",
    "ControllerConfig",
    "ControllerPolicy",
    "LayerController",
    "OptionController",
    "OptionRecord",
    "OptionsConfig",
    "OptionsRunConfig",
    "RandomOptions",
    "baseline_policy",
    "build_controller",
    "load_controlled",
    "run_train",
    "train_options",
]
