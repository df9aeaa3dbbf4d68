"""Write a quantized model as a checkpoint folder, atomically (issue 40 item 2: quantize once).

``save_quantized(model, out)`` takes a model :func:`moectl.quant.quantize_model` quantized and writes
the layout of ``moectl.quant.checkpoint_format``: ``config.json`` with the ``quantization_config``
block, the tensors in safetensors (int4 codes in the portable form of ``portable_int4``, not the
kernel's machine-specific packing), and the source's tokenizer files. The folder is written beside
``out`` and swapped in at the end (``moectl.io.atomic.atomic_dir``): an error or Ctrl-C midway
leaves ``out`` as it was (absent, or the previous folder with ``overwrite``), never half-written.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from moectl.errors import ConfigError, OutputExistsError
from moectl.io.atomic import atomic_dir
from moectl.io.portable_config import make_portable
from moectl.io.safetensors_index import INDEX, SINGLE
from moectl.quant import portable_int4
from moectl.quant.checkpoint_format import TOKENIZER_FILES, quantization_config
from moectl.quant.packed_weights import Int4Weights, QuantizedWeights
from moectl.quant.quantize_model import quantized_scheme

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # Hugging Face's "5GB"


def _stored_weight(name: str, weights: QuantizedWeights) -> dict[str, Tensor]:
    """The tensors one quantized weight is stored as (``checkpoint_format``): int8 as it is held,
    int4 with its codes unpacked to the portable form."""
    if isinstance(weights, Int4Weights):
        n_pad = weights.scale_zero.shape[2]
        k_pad = weights.scale_zero.shape[1] * weights.group
        packed = weights.packed.cpu()
        codes = portable_int4.to_portable(packed, weights.group, n_pad, k_pad)
        return {f"{name}.codes": codes, f"{name}.scale_zero": weights.scale_zero}
    return {f"{name}.codes": weights.codes, f"{name}.scale": weights.scale}


def stored_tensors(model: nn.Module) -> dict[str, Tensor]:
    """Every tensor of the layout, by name, on the CPU: the model's state dict (a tied tensor once,
    under its first name) with each quantized weight in its stored form."""
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedWeights)}
    out: dict[str, Tensor] = {}
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for name, tensor in model.state_dict().items():
        if name.rpartition(".")[0] in quantized:
            continue
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if tensor.numel() and key in seen:  # tied to a tensor stored already (lm_head to embeddings)
            continue
        seen.add(key)
        out[name] = tensor
    for name, weights in quantized.items():
        out.update(_stored_weight(name, weights))
    out = {k: v.detach().cpu().contiguous() for k, v in out.items()}
    storages = Counter(t.untyped_storage().data_ptr() for t in out.values() if t.numel())
    # safetensors refuses tensors that share memory (views of one storage): each gets its own copy
    return {
        k: v.clone() if v.numel() and storages[v.untyped_storage().data_ptr()] > 1 else v
        for k, v in out.items()
    }


def _shards(tensors: dict[str, Tensor], max_shard_bytes: int) -> list[dict[str, Tensor]]:
    """Consecutive tensors in shards of at most ``max_shard_bytes`` (a bigger tensor alone)."""
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def _write_weights(folder: Path, tensors: dict[str, Tensor], max_shard_bytes: int) -> None:
    """Write ``tensors`` as ``model.safetensors`` or Hugging Face's shards and their index."""
    from safetensors.torch import save_file

    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(folder / SINGLE), metadata={"format": "pt"})
        return
    names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's unquantized floating-point weights (the embeddings')."""
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    return param.dtype if param is not None else torch.get_default_dtype()


def _write_config(folder: Path, model: nn.Module, block: dict[str, Any]) -> None:
    config = copy.deepcopy(model.config)
    config.quantization_config = block
    config.architectures = [type(model).__name__]
    config.dtype = _model_dtype(model)
    config.save_pretrained(str(folder))
    make_portable(folder)  # the config keys other loaders read (io/portable_config.py)


def _write_tokenizer(folder: Path, model: nn.Module, source: Path | None, tokenizer: Any) -> None:
    """Copy the source folder's tokenizer files (else save a Hugging Face tokenizer) and the generation
    config. A byte tokenizer writes nothing: the loader falls back to it."""
    copied = [n for n in TOKENIZER_FILES if source is not None and (source / n).is_file()]
    for name in copied:
        shutil.copyfile(source / name, folder / name)
    if not any(n != "generation_config.json" for n in copied) and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(str(folder))
    generation = getattr(model, "generation_config", None)
    if not (folder / "generation_config.json").exists() and generation is not None:
        generation.save_pretrained(str(folder))


def check_out(out: str | Path, overwrite: bool) -> Path:
    """``out`` as a Path when it may be written: new, an empty folder, or with ``overwrite`` a folder
    to replace; ``OutputExistsError`` (a non-empty folder without ``overwrite``) or ``ConfigError``
    (a file) otherwise. Cheap: called before any work."""
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file: give a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputExistsError(f"--out {out} exists and is not empty: pass --overwrite to replace it")
    return out


def save_quantized(
    model: nn.Module,
    out: str | Path,
    *,
    group_size: int | None,
    scope: str,
    source: str | Path | None = None,
    tokenizer: Any = None,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> dict[str, Any]:
    """Write quantized ``model`` to folder ``out`` (``checkpoint_format``) atomically; returns
    ``{"path", "files", "bytes", "tensors", "quantization_config"}``. ``group_size`` and ``scope``:
    what it was quantized with; ``source``: the checkpoint folder whose tokenizer files to copy
    (else ``tokenizer.save_pretrained`` where it has one). ``ConfigError`` for a model that is not
    quantized; ``OutputExistsError`` for a non-empty ``out`` without ``overwrite``."""
    scheme = quantized_scheme(model)
    if scheme is None:
        raise ConfigError("save_quantized needs a quantized model: run moectl.quant.quantize_model first")
    if max_shard_bytes <= 0:
        raise ConfigError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    out = check_out(out, overwrite)
    source_dir = (
        Path(source).expanduser() if source is not None and Path(source).expanduser().is_dir() else None
    )
    block = quantization_config(scheme, group_size, scope)
    tensors = stored_tensors(model)
    with atomic_dir(out, overwrite=True, lock=True) as tmp:
        _write_config(tmp, model, block)
        _write_weights(tmp, tensors, max_shard_bytes)
        _write_tokenizer(tmp, model, source_dir, tokenizer)
        files = sorted(p.name for p in tmp.iterdir() if p.is_file())
        written = sum((tmp / name).stat().st_size for name in files)
    return {
        "path": str(out),
        "files": files,
        "bytes": written,
        "tensors": len(tensors),
        "quantization_config": block,
    }
