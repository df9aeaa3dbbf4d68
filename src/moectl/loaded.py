"""``moectl.load(MODEL)``: a model, its tokenizer and its MoE description in one call (for notebooks).

model, tokenizer, info = moectl.load("tiny:olmoe")      # or a checkpoint folder, a hub id, a .gguf
loaded = moectl.load("runs/emo-small"); loaded.info.top_k
model, tokenizer, info = moectl.load("models/moectl-small-standard", quantize="int4")  # int4 experts
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from torch import nn

from moectl.adapters.inspect import ModelInfo, inspect

if TYPE_CHECKING:
    from moectl.quant.quantize_model import QuantSummary


class Loaded(NamedTuple):
    """What ``moectl.load`` returns: unpack it or read its fields."""

    model: nn.Module
    tokenizer: Any
    info: ModelInfo


def load(
    spec: str,
    *,
    dtype: str = "auto",
    device: str = "cpu",
    seed: int = 0,
    quantize: str | None = None,
    group_size: int | None = None,
    scope: str = "experts",
) -> Loaded:
    """Load ``spec`` — ``tiny:FAMILY``, a checkpoint folder, a hub id or a GGUF file (issue 40 item 3;
    ``moectl.models.load.load_model``)
    — in eval mode with a left-padding tokenizer, and describe its MoE layers (``moectl.inspect``).
    ``seed`` sets a tiny model's random weights.

    ``quantize`` (``int8`` | ``int4``, issue 40) quantizes the experts at load
    (``moectl.quant.quantize_model``; ``scope="all"``: every Linear layer but the routers; int4 in
    groups of ``group_size`` inputs, default ``moectl.quant.DEFAULT_GROUP_SIZE``). The values are
    checked before the model loads. A quantized checkpoint (``moectl checkpoint quantize``) loads
    quantized; ``quantize`` of its own scheme is then a no-op, another scheme a ``ConfigError``."""
    from moectl.models.load import load_model
    from moectl.quant.quant_config import DEFAULT_GROUP_SIZE, check_group_size, check_scheme, check_scope

    if check_scheme(quantize) is not None:
        check_scope(scope)
        check_group_size(DEFAULT_GROUP_SIZE if group_size is None else group_size)  # None: the default
    model, tokenizer = load_model(str(spec), dtype=dtype, device=device, seed=seed)
    if quantize is not None:
        quantize_loaded(model, quantize, group_size=group_size, scope=scope)
    return Loaded(model, tokenizer, inspect(model))


def _is_controller(spec: Any) -> bool:
    """Whether a routing spec (as ``moectl.load_policy`` takes it) names a trained controller folder."""
    if isinstance(spec, dict):
        return spec.get("type") == "controller"
    if not isinstance(spec, (str, os.PathLike)):
        return False
    if str(spec).startswith("controller:"):
        return True
    path = Path(spec).expanduser()
    return path.is_dir() and any((p / "controller.json").is_file() for p in (path, path / "final"))


def quantize_loaded(
    model: nn.Module,
    scheme: str,
    *,
    group_size: int | None = None,
    scope: str = "experts",
    merge_first: Iterable[Any] = (),
) -> QuantSummary | None:
    """``moectl.quant.quantize_model`` on a loaded model, after the controllers among ``merge_first``
    (routing specs, e.g. a server's routings) are attached: a TE-MoE controller's LoRA adapters merge
    into the unquantized weights, so they must be in before the weights are quantized (attaching
    one to a quantized model is refused). The other specs are left to whoever runs them.

    A model loaded quantized already (``moectl checkpoint quantize``, issue 40 item 2) is left as it
    is and None returned when it holds ``scheme`` (``moectl.quant.quantize_model.already_quantized``);
    another scheme, or a controller to merge, is a ``ConfigError``."""
    from moectl.errors import ConfigError
    from moectl.quant.quant_config import DEFAULT_GROUP_SIZE
    from moectl.quant.quantize_model import already_quantized, quantize_model
    from moectl.routing import load_policy

    merge_first = list(merge_first)
    if already_quantized(model, scheme, group_size):
        controller = next((spec for spec in merge_first if _is_controller(spec)), None)
        if controller is not None:
            raise ConfigError(
                f"controller {controller} merges its adapters into unquantized weights, and this model "
                f"is quantized already ({scheme}): quantize the unquantized model with the controller"
            )
        return None
    for spec in merge_first:
        if _is_controller(spec):
            load_policy(spec, model)  # merges once per model (options.policy remembers it)
    size = DEFAULT_GROUP_SIZE if group_size is None else group_size
    return quantize_model(model, scheme, group_size=size, scope=scope)
