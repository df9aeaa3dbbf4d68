"""Saving and loading what options training produces: controller, LoRA adapters, routers.

A folder (the final output or ``checkpoints/step-N``) holds ``controller.json`` +
``controller.safetensors``, ``adapter.safetensors`` + ``adapter_config.json`` (LoRA weights
under PEFT's keys and PEFT's config, when the intra-option policy was trained; the expert
adapters of ``expert_lora.py`` as PEFT ``target_parameters``), ``routers.safetensors`` (trained router weights) and ``options.json``
(the training configuration). Checkpoints also hold ``trainer_state.pt`` (optimizers, the
step, every generator's state). Folders are written beside their final name and renamed in.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moectl.adapters.inspect import ModelInfo, inspect
from moectl.errors import ConfigError, MoectlFileError, NotSupportedError
from moectl.options.controller import OptionController
from moectl.options.expert_lora import (
    add_expert_lora,
    attach_pending_expert_lora,
    expert_lora_rank,
    expert_lora_state_dict,
    expert_lora_target_parameters,
    experts_modules,
    load_expert_lora_state_dict,
    merge_expert_lora,
    unsupported_reason,
)
from moectl.options.teacher import router_snapshot
from moectl.train.checkpoint import commit_checkpoint, latest_in, write_dir_atomic


def save_folder(
    path: Path,
    controller: OptionController,
    model: nn.Module,
    info: ModelInfo,
    config: dict,
    trainer_state: dict | None = None,
) -> Path:
    """Write the folder atomically (temp folder, then rename)."""
    from safetensors.torch import save_file

    def write(tmp: Path) -> None:
        controller.save(tmp)
        lora, peft_config = adapter_files(model)
        if lora:
            save_file(lora, str(tmp / "adapter.safetensors"))
            (tmp / "adapter_config.json").write_text(json.dumps(peft_config, default=list) + "\n")
        routers = {
            f"layer{layer.index}": layer.router.weight.detach().contiguous().cpu() for layer in info.layers
        }
        save_file(routers, str(tmp / "routers.safetensors"))
        (tmp / "options.json").write_text(json.dumps(config, indent=2) + "\n")
        if trainer_state is not None:
            torch.save(trainer_state, tmp / "trainer_state.pt")

    return write_dir_atomic(Path(path), write)


def adapter_files(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(adapter weights under PEFT's keys, PEFT adapter config) of ``model``: PEFT's adapters and
    the expert adapters of ``expert_lora`` (listed as ``target_parameters``, so PEFT loads them too)."""
    lora: dict[str, torch.Tensor] = {}
    config: dict[str, Any] = {}
    if hasattr(model, "peft_config"):
        from peft import get_peft_model_state_dict

        lora = {k: v.detach().contiguous().cpu() for k, v in get_peft_model_state_dict(model).items()}
        config = model.peft_config["default"].to_dict()
    rank = expert_lora_rank(model)
    if rank is not None:
        if not config:
            from peft import LoraConfig

            config = LoraConfig(r=rank[0], lora_alpha=rank[1]).to_dict()
        lora.update(expert_lora_state_dict(model))
        config["target_parameters"] = expert_lora_target_parameters(model)
    return lora, config


def save_checkpoint(
    out: Path, step: int, controller, model, info, config: dict, trainer_state: dict, keep: int = 2
) -> Path:
    """Write ``out/checkpoints/step-N`` (with trainer_state.pt) as ``latest``; keep the newest ``keep``."""
    path = Path(out) / "checkpoints" / f"step-{step:06d}"
    return commit_checkpoint(
        save_folder(path, controller, model, info, config, {**trainer_state, "step": step}), keep
    )


def latest_checkpoint(out: Path) -> Path | None:
    """The checkpoint that ``out/checkpoints/latest`` names, if complete, else None."""
    return latest_in(Path(out) / "checkpoints")


def load_weights(path: Path, model: nn.Module, info: ModelInfo) -> None:
    """Load adapter and router weights saved by :func:`save_folder` into ``model`` (in place)."""
    from safetensors.torch import load_file

    path = Path(path)
    if (path / "adapter.safetensors").exists():
        state = load_file(str(path / "adapter.safetensors"))
        used = load_expert_lora_state_dict(model, state)
        if (path / "adapter_config.json").exists():  # experts not in memory: their deltas wait for the loads
            cfg = json.loads((path / "adapter_config.json").read_text())
            used |= attach_pending_expert_lora(model, state, cfg["r"], cfg["lora_alpha"])
        if hasattr(model, "peft_config"):
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(model, {k: v for k, v in state.items() if k not in used})
    if (path / "routers.safetensors").exists():
        routers = load_file(str(path / "routers.safetensors"))
        with torch.no_grad():
            for layer in info.layers:
                layer.router.weight.copy_(routers[f"layer{layer.index}"])


def controller_dir(path: str | Path) -> Path:
    """The folder holding a trained controller: a run folder's ``final/`` if it has one, else ``path``."""
    path = Path(path)
    return path / "final" if (path / "final" / "controller.json").exists() else path


def check_controller_dir(path: str | Path) -> Path:
    """The controller folder for ``path`` (see :func:`controller_dir`); FileNotFoundError if it is none."""
    folder = controller_dir(path)
    if not (folder / "controller.json").exists():
        raise MoectlFileError(
            f"{path}: not a controller folder (needs controller.json and controller.safetensors, "
            "as `moectl options train` writes)"
        )
    return folder


def load_controlled(
    model: nn.Module, path: str | Path, merge: bool = True
) -> tuple[nn.Module, OptionController, dict[str, Any], list | None]:
    """Apply a trained folder to ``model``: LoRA adapters, trained routers, and the controller.

    Returns (model, controller, options config, router snapshot). With ``merge`` the adapters
    are merged into the weights (a plain transformers model at inference; snapshot None);
    without, the PEFT model is returned with the original routers' snapshot, so that
    ``teacher_mode`` gives the original model back (for measuring quality against it).
    ``path`` is the trained folder or the run folder around it (see :func:`controller_dir`).
    """
    path = controller_dir(path)
    controller = OptionController.load(path, device=next(model.parameters()).device)
    info = inspect(model)
    controller.check(info)
    config = json.loads((path / "options.json").read_text()) if (path / "options.json").exists() else {}
    if (path / "adapter.safetensors").exists():
        from moectl.quant.quantize_model import quantized_scheme

        if quantized_scheme(model) is not None:  # PEFT would skip the quantized modules with a warning
            raise NotSupportedError(  # short: the policy loader quotes 200 characters of it
                f"its adapters merge into unquantized weights, the model is {quantized_scheme(model)}: attach "
                "the controller before quantizing (moectl.loaded.quantize_loaded's merge_first)"
            )
        from peft import LoraConfig

        from moectl.models.peft_quiet import get_peft_model

        cfg = json.loads((path / "adapter_config.json").read_text())
        targets = cfg.get("target_modules") or None
        experts = cfg.get("target_parameters") or None
        found = experts_modules(model, info) if experts else []
        # experts on the meta device (a lazily loaded checkpoint): no weight to merge into; their
        # adapters are attached as pending deltas, added as each expert is loaded (load_weights)
        lazy = any(getattr(getattr(m, "down_proj", None), "is_meta", False) for _, m in found)
        cheap = bool(found) and not lazy and all(unsupported_reason(m) is None for _, m in found)
        snapshot = router_snapshot(info)
        peft_model = model
        if targets or (experts and not cheap and not lazy):
            lora = LoraConfig(
                r=cfg["r"],
                lora_alpha=cfg["lora_alpha"],
                target_modules=targets,
                target_parameters=None if cheap or lazy else experts,
            )
            peft_model = get_peft_model(model, lora)
        if cheap:  # the expert adapters on the selected experts' activations (expert_lora.py)
            add_expert_lora(peft_model, info, cfg["r"], cfg["lora_alpha"])
        load_weights(path, peft_model, inspect(peft_model))
        if not merge:
            return peft_model, controller, config, snapshot
        merge_expert_lora(peft_model)
        model = peft_model.merge_and_unload() if peft_model is not model else model
        info = inspect(model)
    snapshot = None if merge else router_snapshot(info)
    load_weights(path, model, info)
    return model, controller, config, snapshot


def attach_controller(
    model: nn.Module, controller: str | Path | None, merge: bool = True
) -> tuple[nn.Module, OptionController | None, dict[str, Any], list | None]:
    """``(model, controller, options config, router snapshot)`` with the controller at ``controller``
    attached (None: the plain model, no controller).

    ``merge`` reads it through the one policy loader (a controller folder, a run folder or a
    controller policy file; its adapters and routers merge into ``model``; no snapshot). Without
    ``merge`` the PEFT adapters stay separate and the snapshot of the routers is the teacher.
    """
    if controller is None:
        return model, None, {}, None
    if merge:
        from moectl.options.policy import ControllerPolicy
        from moectl.routing.policy_files import load_policy

        policy = load_policy(controller, model)
        if not isinstance(policy, ControllerPolicy):
            raise ConfigError(f"--controller {controller}: not a controller (got {type(policy).__name__})")
        return model, policy.controller, policy.options, None
    model, ctrl, config, snapshot = load_controlled(model, controller, merge=False)
    model.eval()
    inspect(model)
    return model, ctrl, config, snapshot
