"""Load a moectl quantized checkpoint, quantized, without quantizing again (issue 40 item 2).

``moectl.models.load.load_model`` sends a folder whose ``config.json`` carries a moectl
``quantization_config`` (``moectl.quant.checkpoint_format``) here, so ``moectl.load(DIR)`` and every
verb that takes a MODEL read it. The model is built on the meta device from its config
(``moectl.models.meta_model.build_meta``: the class, dtypes and float32 exceptions
``from_pretrained`` gives), each quantized module is put in place with the codes and scales read
from the checkpoint (int4 codes packed for this machine's kernel: ``portable_int4.to_kernel``), the
other tensors are assigned as they are stored, and the non-persistent buffers (rotary frequencies)
are computed as ``from_pretrained`` computes them (``moectl.models.meta_buffers``). A tensor the
checkpoint lacks, one it has that the model does not, or a shape that does not match is a
``FileFormatError`` naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from moectl.errors import ConfigError, FileFormatError
from moectl.io.range_read import DEFAULT_READ_METHOD
from moectl.io.safetensors_index import CheckpointIndex
from moectl.quant import portable_int4
from moectl.quant.checkpoint_format import EXPERTS_PARTS, LINEAR_PART, STORED, checkpoint_block
from moectl.quant.checkpoint_store import QuantizedCheckpointStore, experts_modules
from moectl.quant.int4_groups import ROW_ALIGN
from moectl.quant.packed_weights import Int4Weights, Int8Weights, QuantizedWeights
from moectl.quant.quant_config import GROUP_SIZES
from moectl.quant.quantized_experts import QuantizedExperts
from moectl.quant.quantized_linear import QuantizedLinear

TOKENIZER_MARKS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _experts_key(key: str) -> bool:
    """Whether ``key`` is a quantized experts tensor (``P.gate_up.codes``, ``P.down.scale_zero``, ...)."""
    parts = key.split(".")
    return (
        len(parts) >= 3
        and parts[-2] in EXPERTS_PARTS
        and parts[-1] in {p for s in STORED.values() for p in s}
    )


def read_tensors(folder: Path) -> dict[str, Tensor]:
    """Every tensor of the checkpoint's safetensors file(s), by name, each in memory of its own, but
    the quantized experts' (``P.gate_up.codes``, ...): meta tensors of their stored shape, unread —
    :class:`QuantizedCheckpointStore` reads those, a layer or an expert at a time.

    ``safe_open(...).get_tensor`` gives tensors at the file's offsets (here 24 bytes past a 64-byte
    boundary); ``aten._weight_int8pack_mm`` crashes (SIGSEGV, torch 2.13 CPU) on codes so placed,
    so each is copied into a fresh, aligned allocation."""
    from safetensors import safe_open

    index = CheckpointIndex(folder)
    tensors: dict[str, Tensor] = {}
    for file in index.files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if _experts_key(key):
                    entry = index[key]
                    tensors[key] = torch.empty(entry.shape, dtype=entry.dtype, device="meta")
                    continue
                tensor = handle.get_tensor(key)
                tensors[key] = torch.empty_like(tensor, memory_format=torch.contiguous_format).copy_(tensor)
    return tensors


def _take(tensors: dict[str, Tensor], key: str, where: Path) -> Tensor:
    if key not in tensors:
        raise FileFormatError(f"{where}: the quantized checkpoint lacks tensor {key}")
    return tensors.pop(key)


def _expect(tensor: Tensor, shape: tuple[int, ...], key: str, where: Path) -> None:
    if tuple(tensor.shape) != shape:
        raise FileFormatError(
            f"{where}: tensor {key} has shape {list(tensor.shape)}, the model's config needs {list(shape)}"
        )


def stored_weights(
    tensors: dict[str, Tensor], name: str, scheme: str, shape: tuple[int, int, int], dtype: torch.dtype,
    where: Path,
) -> QuantizedWeights:  # fmt: skip
    """The :class:`QuantizedWeights` stored under ``name`` for an [E, N, K] weight of ``shape`` (its
    tensors taken out of ``tensors``), checked against the shape."""
    codes_key, scale_key = (f"{name}.{part}" for part in STORED[scheme])
    codes, scale = _take(tensors, codes_key, where), _take(tensors, scale_key, where)
    e, n, k = shape
    if scheme == "int8":
        _expect(codes, shape, codes_key, where)
        _expect(scale, (e, n), scale_key, where)
        return Int8Weights.from_stored(codes.to(torch.int8), scale.float(), dtype)
    n_pad, k_pad = -(-n // ROW_ALIGN) * ROW_ALIGN, codes.shape[-1] * 2
    groups = scale.shape[1] if scale.dim() == 4 else 0
    group = k_pad // groups if groups else 0
    if group not in GROUP_SIZES or k_pad != -(-k // group) * group:
        raise FileFormatError(
            f"{where}: tensors {codes_key} {list(codes.shape)} and {scale_key} {list(scale.shape)} do "
            f"not hold int4 groups of a [{n}, {k}] weight"
        )
    _expect(codes, (e, n_pad, k_pad // 2), codes_key, where)
    _expect(scale, (e, groups, n_pad, 2), scale_key, where)
    packed = portable_int4.to_kernel(codes.to(torch.uint8))
    return Int4Weights.from_stored(packed, scale.to(dtype), group, shape, dtype)


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _prefixes(keys: list[str], part: str) -> list[str]:
    suffix = f".{part}.codes"
    return sorted(k[: -len(suffix)] for k in keys if k.endswith(suffix))


def _module(model: nn.Module, name: str, where: Path) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise FileFormatError(
            f"{where}: quantized tensors for {name}, which the model's config has not"
        ) from None


def put_quantized_modules(
    model: nn.Module, tensors: dict[str, Tensor], scheme: str, dtype: torch.dtype, where: Path
) -> int:
    """Replace every module the checkpoint holds quantized (experts: ``P.gate_up.codes``; a Linear
    layer: ``P.qweight.codes``) by its quantized form read from ``tensors``; how many."""
    keys = list(tensors)
    experts_names, linear_names = _prefixes(keys, EXPERTS_PARTS[0]), _prefixes(keys, LINEAR_PART)
    for name in experts_names:
        experts = _module(model, name, where)
        if not (hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj")):
            raise FileFormatError(
                f"{where}: {name} holds quantized experts, the model's is {type(experts).__name__}"
            )
        weights = tuple(
            stored_weights(
                tensors, f"{name}.{part}", scheme, tuple(getattr(experts, proj).shape), dtype, where
            )
            for part, proj in zip(EXPERTS_PARTS, ("gate_up_proj", "down_proj"), strict=True)
        )
        _replace(model, name, QuantizedExperts(experts, scheme, 0, weights=weights))
    for name in linear_names:
        linear = _module(model, name, where)
        if not isinstance(linear, nn.Linear):
            raise FileFormatError(
                f"{where}: {name} holds a quantized Linear weight, the model's is {type(linear).__name__}"
            )
        shape = (1, linear.out_features, linear.in_features)
        weight = stored_weights(tensors, f"{name}.{LINEAR_PART}", scheme, shape, dtype, where)
        _replace(model, name, QuantizedLinear(linear, scheme, 0, weight=weight))
    return len(experts_names) + len(linear_names)


def assign_tensors(model: nn.Module, tensors: dict[str, Tensor], where: Path) -> None:
    """Put every other stored tensor in place (each name tied to it too), in the model's dtype for
    it; ``FileFormatError`` for an unknown name, a wrong shape, or a tensor left unloaded."""
    from moectl.models.meta_model import set_tensor

    aliases: dict[int, list[str]] = {}
    for name, tensor in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        aliases.setdefault(id(tensor), []).append(name)
    by_name = {name: names for names in aliases.values() for name in names}
    slots = dict(
        [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    )
    for key, value in tensors.items():
        if key not in by_name:
            raise FileFormatError(f"{where}: tensor {key} is not in the model its config.json builds")
        _expect(value, tuple(slots[key].shape), key, where)
        value = value.to(slots[key].dtype)
        for name in by_name[key]:
            set_tensor(model, name, value)
    missing = [n for n, t in model.named_parameters() if t.is_meta]
    persistent = [
        f"{owner}.{leaf}" if owner else leaf
        for owner, module in model.named_modules()
        for leaf, buffer in module.named_buffers(recurse=False)
        if buffer is not None
        and buffer.is_meta
        and leaf not in module._non_persistent_buffers_set
        and not _lazy_experts(model, owner)
    ]
    if missing or persistent:
        raise FileFormatError(
            f"{where}: the quantized checkpoint lacks {len(missing) + len(persistent)} tensors, e.g. "
            f"{(missing + persistent)[0]}"
        )


def _lazy_experts(model: nn.Module, owner: str) -> bool:
    """Whether module ``owner`` is a part of quantized experts, left unread by :func:`read_tensors`."""
    parent, _, leaf = owner.rpartition(".")
    return leaf in EXPERTS_PARTS and isinstance(model.get_submodule(parent), QuantizedExperts)


def _tokenizer(folder: Path, vocab_size: int) -> Any:
    from moectl.models.load import byte_tokenizer, padding_left

    if not any((folder / name).is_file() for name in TOKENIZER_MARKS):
        return byte_tokenizer(vocab_size)  # tiny: and shape: models
    from transformers import AutoTokenizer

    return padding_left(AutoTokenizer.from_pretrained(str(folder)))


@torch.no_grad()
def load_quantized(
    folder: str | Path,
    dtype: str = "auto",
    device: str = "cpu",
    device_map: str | None = None,
    with_tokenizer: bool = True,
) -> tuple[nn.Module, Any]:
    """(model in eval mode, tokenizer or None) of quantized checkpoint ``folder``. ``dtype``: the
    unquantized weights' and the activations' (``auto``: the checkpoint's); int4 runs on the CPU only.

    The experts are read a layer at a time through :class:`QuantizedCheckpointStore` (int4 codes
    from its kernel-layout cache, written on the first load): peak memory is the model plus one
    layer's experts, not the file read whole and then repacked (OLMoE-1B-7B dims, int4: 8.5 GB
    peak RSS for a 3.8 GB folder before)."""
    from moectl.models.load import place

    folder = Path(folder).expanduser()
    model, tokenizer, store = _build(folder, dtype, with_tokenizer, DEFAULT_READ_METHOD)
    try:
        if store.scheme == "int4" and (device_map is not None or torch.device(device).type != "cpu"):
            raise ConfigError(f"{folder} is int4, which runs PyTorch's CPU kernel: load it with --device cpu")
        for layer in store.layers:
            experts = model.get_submodule(layer.module)
            for name, tensor in store.read_layer(layer.index).items():
                part, leaf = name.split(".")
                getattr(experts, part).register_buffer(leaf, tensor)
    finally:
        store.close()
    return _for_cpu(place(model, device, device_map)), tokenizer


@torch.no_grad()
def load_quantized_lazy(
    folder: str | Path,
    dtype: str = "auto",
    device: str = "cpu",
    method: str = DEFAULT_READ_METHOD,
    with_tokenizer: bool = True,
) -> tuple[nn.Module, Any, QuantizedCheckpointStore]:
    """(model, tokenizer, store) of quantized checkpoint ``folder`` with its experts left unread (on
    the meta device) for offloading: the store reads each expert's quantized slices on demand
    (``moectl.offload`` loads them into resident slots; close the store when done). CPU only."""
    if torch.device(device).type != "cpu":
        raise ConfigError(
            f"offloading a quantized checkpoint's experts runs on the CPU (got device {device!r}): "
            "use --device cpu, or serve it whole"
        )
    model, tokenizer, store = _build(Path(folder).expanduser(), dtype, with_tokenizer, method)
    return _for_cpu(model), tokenizer, store


def _build(
    folder: Path, dtype: str, with_tokenizer: bool, method: str
) -> tuple[nn.Module, Any, QuantizedCheckpointStore]:
    """(model on the CPU in eval mode with its quantized experts on meta, tokenizer or None, the
    store that reads those experts)."""
    from moectl.models.meta_buffers import materialize_buffers
    from moectl.models.meta_model import build_meta, load_config, resolve_dtype

    block = checkpoint_block(folder)
    if block is None:
        raise FileFormatError(
            f"{folder} is not a moectl quantized checkpoint (no quantization_config in config.json)"
        )
    config = load_config(folder)
    del config.quantization_config  # transformers has no quantizer "moectl"; the modules say it
    compute = resolve_dtype(dtype, config)
    model = build_meta(config, compute)
    tensors = read_tensors(folder)
    put_quantized_modules(model, tensors, block["scheme"], compute, folder)
    assign_tensors(model, tensors, folder)
    materialize_buffers(model, "cpu")
    if (folder / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(folder))
    tokenizer = _tokenizer(folder, model.config.vocab_size) if with_tokenizer else None
    store = QuantizedCheckpointStore(folder, experts_modules(model), block["scheme"], compute, method)
    return model.eval(), tokenizer, store


def _for_cpu(model: nn.Module) -> nn.Module:
    """The model once placed, as ``load_model`` gives it: CPU experts' implementation and moectl's
    bf16 kernel for the unquantized Linear layers."""
    from moectl.kernels.cpu_linear import install as install_cpu_linear
    from moectl.models.grouped_experts import prefer_on_cpu

    prefer_on_cpu(model)
    install_cpu_linear(model)
    return model
