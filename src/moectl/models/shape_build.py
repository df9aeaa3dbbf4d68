"""Build a real model's shape with random weights: spec strings, configs, models, parameter counts.

A spec is ``shape:NAME[@LAYERS][~wWIDTH]``:

- ``NAME`` — a preset of ``moectl.models.shape_presets`` (``olmoe-1b-7b``, ``deepseek-v3``, …);
- ``@LAYERS`` — that many decoder layers instead of the model's own count. The layer pattern
  (gpt-oss's sliding/full alternation, DeepSeek's leading dense layers) is kept, except that the
  leading dense layers are capped at ``LAYERS - 1`` so at least one MoE layer remains
  (``deepseek-v3@2`` = one dense layer + one MoE layer);
- ``~wWIDTH`` — the reduced-width variant for tests: ``hidden_size = WIDTH`` and every other width
  (head, expert, shared-expert, dense-MLP and MLA low-rank dimensions) scaled by the same factor
  (families without an explicit head_dim keep head_dim = WIDTH / heads, so WIDTH must be an even
  multiple of the head count there),
  rounded to a multiple of 8 (transformers' grouped expert matmul needs 16-byte strides in bf16).
  Counts are kept: layers, heads, experts, top-k, groups and the
  vocabulary, so routing runs the same code paths as at full width.

In Python the same knobs are ``num_layers=`` and ``width=``; any other keyword overrides a config
value verbatim (after truncation and narrowing).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from moectl.errors import ConfigError, MemoryLimitError
from moectl.models.shape_layout import checkpoint_pieces
from moectl.models.shape_presets import PRESETS
from moectl.models.shape_values import fill_values

SPEC_PREFIX = "shape:"
_SPEC = re.compile(r"(?P<name>[A-Za-z0-9._-]+?)(?:@(?P<layers>\d+))?(?:~w(?P<width>\d+))?")
_WIDTH_KEYS = (
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "head_dim",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)
_TOP_K_KEYS = ("num_experts_per_tok", "moe_k", "moe_topk", "experts_per_token")


def known_shapes() -> tuple[str, ...]:
    """The preset names."""
    return tuple(PRESETS)


@dataclass(frozen=True)
class ShapeSpec:
    """A parsed ``shape:NAME[@LAYERS][~wWIDTH]``."""

    name: str
    num_layers: int | None = None
    width: int | None = None

    def __str__(self) -> str:
        layers = f"@{self.num_layers}" if self.num_layers is not None else ""
        width = f"~w{self.width}" if self.width is not None else ""
        return f"{SPEC_PREFIX}{self.name}{layers}{width}"


def _known(name: str) -> str:
    key = name.lower()
    if key not in PRESETS:
        raise ConfigError(f"unknown shape {name!r}; known shapes: {', '.join(PRESETS)}")
    return key


def parse_shape_spec(spec: str) -> ShapeSpec:
    """Parse ``shape:NAME[@LAYERS][~wWIDTH]`` (the ``shape:`` prefix is optional)."""
    body = spec[len(SPEC_PREFIX) :] if spec.startswith(SPEC_PREFIX) else spec
    match = _SPEC.fullmatch(body)
    if match is None:
        raise ConfigError(
            f"bad shape spec {spec!r}: expected shape:NAME[@LAYERS][~wWIDTH], e.g. shape:olmoe-1b-7b@2~w64; "
            f"known shapes: {', '.join(PRESETS)}"
        )
    layers, width = match["layers"], match["width"]
    return ShapeSpec(_known(match["name"]), int(layers) if layers else None, int(width) if width else None)


def _truncate(values: dict[str, Any], num_layers: int) -> None:
    """Keep ``num_layers`` decoder layers, the layer pattern, and at least one MoE layer."""
    if num_layers < 1:
        raise ConfigError(f"a shape needs at least one layer, got {num_layers}")
    values["num_hidden_layers"] = num_layers
    if values.get("layer_types"):
        pattern = values["layer_types"]
        values["layer_types"] = [pattern[i % len(pattern)] for i in range(num_layers)]
    if "first_k_dense_replace" in values:
        values["first_k_dense_replace"] = min(values["first_k_dense_replace"], num_layers - 1)
    if "mlp_only_layers" in values:
        values["mlp_only_layers"] = [i for i in values["mlp_only_layers"] if i < num_layers]


def _narrow(values: dict[str, Any], width: int) -> None:
    """Set ``hidden_size = width`` and scale every other width by the same factor (multiples of 8)."""
    if width < 8 or width % 8:
        raise ConfigError(f"a reduced width must be a positive multiple of 8, got {width}")
    factor = width / values["hidden_size"]

    def scaled(size: int) -> int:
        return max(8, 8 * round(size * factor / 8))

    heads = values["num_attention_heads"]
    if (
        "head_dim" not in values
        and "qk_rope_head_dim" not in values
        and (width % heads or width // heads % 2)
    ):
        # head_dim is hidden_size / heads in these families (OLMoE's QK-norm spans hidden_size)
        raise ConfigError(
            f"a reduced width must be an even multiple of the {heads} attention heads, got {width}"
        )
    for key in _WIDTH_KEYS:
        if values.get(key) is not None:
            values[key] = scaled(values[key])
    if "qk_rope_head_dim" in values:  # MLA: the rotary part is what transformers calls head_dim
        values["head_dim"] = values["qk_rope_head_dim"]
    values["hidden_size"] = width


def shape_config(
    name: str, num_layers: int | None = None, width: int | None = None, **overrides: Any
) -> PretrainedConfig:
    """The transformers config of preset ``name`` (or a full ``shape:`` spec string).

    ``num_layers`` and ``width`` override the spec's ``@LAYERS`` and ``~wWIDTH``; other keywords
    set config values verbatim. An unknown name raises ``ValueError`` listing the known ones.
    """
    spec = parse_shape_spec(name)
    num_layers = spec.num_layers if num_layers is None else num_layers
    width = spec.width if width is None else width
    values = copy.deepcopy(PRESETS[spec.name])
    model_type = values.pop("model_type")
    if num_layers is not None:
        _truncate(values, num_layers)
    if width is not None:
        _narrow(values, width)
    values.update(overrides)
    shape = str(ShapeSpec(spec.name, num_layers, width))
    try:
        config = AutoConfig.for_model(model_type, **values)
    except Exception as err:  # transformers validates shapes (e.g. hidden size vs heads)
        extra = f" with overrides {overrides}" if overrides else ""
        raise ConfigError(f"cannot configure {shape}{extra}: {err}") from err
    config.moectl_shape = shape  # recorded in config.json; overrides show in the values themselves
    return config


def state_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor a checkpoint of ``model`` holds: parameters (tied ones once), persistent buffers."""
    yield from model.named_parameters()
    for module_name, module in model.named_modules():
        for buffer_name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer_name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{buffer_name}" if module_name else buffer_name), buffer


def _meta_model(config: PretrainedConfig, dtype: torch.dtype) -> PreTrainedModel:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@torch.no_grad()
def fill_model(model: PreTrainedModel, seed: int = 0) -> PreTrainedModel:
    """Give every checkpoint tensor of ``model`` its deterministic values (see ``shape_values``)."""
    model_type = model.config.model_type
    for name, tensor in state_tensors(model):
        for piece in checkpoint_pieces(model_type, name, tuple(tensor.shape)):
            fill_values(tensor.data[piece.index] if piece.index else tensor.data, piece.key, seed)
    return model


def build_from_config(
    config: PretrainedConfig, dtype: torch.dtype = torch.bfloat16, device: str = "meta", seed: int = 0
) -> PreTrainedModel:
    """A model of ``config`` in eval mode: on ``meta`` (no memory) or filled with seeded values."""
    if str(device) == "meta":
        return _meta_model(config, dtype).eval()
    from transformers.initialization import no_init_weights

    need = parameter_counts(_meta_model(config, dtype))["bytes"]
    available = _available_memory()
    if str(device) == "cpu" and available is not None and need > available:
        raise MemoryLimitError(
            f"{getattr(config, 'moectl_shape', config.model_type)} needs {need / 2**30:.1f} GiB of weights "
            f"but {available / 2**30:.1f} GiB is available; build it on device='meta', with fewer layers "
            f"(@LAYERS) or reduced width (~wWIDTH), or stream it to disk with write_shape_checkpoint"
        )
    with no_init_weights(), torch.device(device):  # no default init: every tensor is filled below
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return fill_model(model, seed).eval()


def build_shape(
    name: str,
    num_layers: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "meta",
    seed: int = 0,
    width: int | None = None,
    **overrides: Any,
) -> PreTrainedModel:
    """Preset ``name`` (or a ``shape:`` spec) as a transformers model with random weights.

    On ``device="meta"`` nothing is allocated (shapes, parameter counts, hooks); on a real device
    each tensor is filled chunk by chunk from a generator seeded by (seed, its checkpoint name),
    so ``write_shape_checkpoint`` with the same seed writes exactly these weights.
    """
    config = shape_config(name, num_layers, width=width, **overrides)
    return build_from_config(config, dtype=dtype, device=device, seed=seed)


def top_k_of(config: PretrainedConfig) -> int:
    """Routed experts chosen per token, whatever the family calls it."""
    for key in _TOP_K_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"no top-k in the config of {config.model_type}")


def is_routed_expert(name: str) -> bool:
    """Tensors of the routed experts (shared experts are always active and do not count)."""
    return ".experts." in f".{name}"


def parameter_counts(model: PreTrainedModel) -> dict[str, int]:
    """Parameter counts of a (meta or real) model.

    ``active`` is what one token uses: every parameter except the routed experts it is not routed
    to (top-k of E at every MoE layer), the input embedding table included;
    ``active_without_embedding`` leaves that table out (OpenAI's and DeepSeek's convention).
    ``bytes`` is the size of every checkpoint tensor (parameters and persistent buffers).
    """
    top_k = top_k_of(model.config)
    total = routed = routed_active = 0
    for name, param in model.named_parameters():
        total += param.numel()
        if is_routed_expert(name):
            routed += param.numel()
            routed_active += param.numel() // param.shape[0] * top_k
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is embedding
    active = total - routed + routed_active
    return {
        "total": total,
        "active": active,
        "active_without_embedding": active - (0 if tied else embedding.numel()),
        "routed_experts": routed,
        "non_expert": total - routed,
        "embedding": embedding.numel(),
        "top_k": top_k,
        "bytes": sum(t.numel() * t.element_size() for _, t in state_tensors(model)),
    }
