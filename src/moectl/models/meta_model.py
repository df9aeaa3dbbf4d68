"""A checkpoint's model on the meta device: shapes and dtypes, no memory
(docs/architecture.md, "Memory by design").

``build_meta(config, dtype)`` makes the model ``AutoModelForCausalLM.from_pretrained`` would make,
before any weight is loaded: the same class and config, the same dtype (``None``/``"auto"`` is the
checkpoint config's dtype, as ``from_pretrained``'s default ``dtype="auto"``), and the same
``keep_in_fp32`` exceptions (transformers' dtype plan: e.g. DeepSeek-V3's
``e_score_correction_bias`` stays float32 in a bf16 model). ``set_tensor`` swaps one parameter or
buffer for a real tensor, keeping tied parameters tied by passing the same tensor to each name.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from moectl.errors import ConfigError, FileFormatError


def resolve_dtype(dtype: torch.dtype | str | None, config: PretrainedConfig) -> torch.dtype:
    """``None`` / ``"auto"``: the config's dtype (float32 when it has none); a name or a dtype."""
    if dtype is None or dtype == "auto":
        dtype = getattr(config, "dtype", None) or torch.get_default_dtype()
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(resolved, torch.dtype):
            raise ConfigError(f"unknown dtype {dtype!r} (expected e.g. 'bfloat16', 'float32' or 'auto')")
        dtype = resolved
    if not dtype.is_floating_point:
        raise ConfigError(f"a model dtype must be a floating-point type, got {dtype}")
    return dtype


def load_config(path: str | Path) -> PretrainedConfig:
    """The ``config.json`` of a checkpoint folder; ``ValueError`` naming the folder if absent."""
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise FileFormatError(f"{folder}: no config.json (expected a checkpoint folder as save_pretrained writes)")
    try:
        return AutoConfig.from_pretrained(str(folder))
    except (OSError, ValueError) as err:  # not JSON, an unknown model_type, ...
        raise FileFormatError(f"{folder / 'config.json'}: {err}") from None


def set_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Replace parameter or buffer ``name`` of ``model`` by ``tensor`` (a parameter stays one)."""
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    if leaf in module._parameters:
        old = module._parameters[leaf]
        if not isinstance(tensor, nn.Parameter):
            tensor = nn.Parameter(tensor, requires_grad=old.requires_grad if old is not None else False)
        module._parameters[leaf] = tensor
    elif leaf in module._buffers:
        module._buffers[leaf] = tensor
    else:
        raise KeyError(f"{name} is neither a parameter nor a buffer of {type(model).__name__}")


def fp32_names(model: PreTrainedModel, dtype: torch.dtype) -> re.Pattern[str] | None:
    """The tensors transformers keeps in float32 at ``dtype`` (``_keep_in_fp32_modules[_strict]``)."""
    patterns: list[str] = []
    if dtype == torch.float16:
        patterns += list(getattr(model, "_keep_in_fp32_modules", None) or [])
    if dtype in (torch.float16, torch.bfloat16):
        patterns += list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    if not patterns:
        return None
    return re.compile("|".join(p.replace("*", ".*") for p in patterns))


def build_meta(config: PretrainedConfig, dtype: torch.dtype | str | None = None) -> PreTrainedModel:
    """The causal-LM model of ``config`` on the meta device, in eval mode, with from_pretrained's dtypes."""
    config = copy.deepcopy(config)
    dtype = resolve_dtype(dtype, config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    keep = fp32_names(model, dtype)
    if keep is not None:
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if keep.search(name) and tensor.dtype.is_floating_point and tensor.dtype != torch.float32:
                set_tensor(model, name, tensor.detach().to(torch.float32))
    return model.eval()
