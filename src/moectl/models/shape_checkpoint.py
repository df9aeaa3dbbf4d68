"""Write a shape as a sharded safetensors checkpoint, streamed; check a checkpoint's shards.

The layout is Hugging Face's sharded format: ``config.json``, ``model-0000i-of-0000N.safetensors``
and ``model.safetensors.index.json`` (``metadata.total_size`` and a sorted ``weight_map``), with
one tensor per expert and projection under each family's released names (``shape_layout``), so
``AutoModelForCausalLM.from_pretrained`` fuses them exactly as it does a downloaded checkpoint.
``moectl_shape.json`` marks the folder as a moectl shape: there is no tokenizer (moectl reads it
with its byte tokenizer).

Nothing ever holds the model: the model is built on the meta device to plan the tensors, and
each shard's safetensors header is written first, then every tensor's bytes chunk by chunk from
``shape_values`` (peak memory: one chunk, 32 MB, plus the meta model). The folder is assembled
beside the target and renamed into place at the end; on any error nothing is left behind.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig

from moectl.errors import ConfigError, OutputExistsError, UnavailableError
from moectl.io.atomic import default_mode
from moectl.io.portable_config import make_portable
from moectl.io.safetensors_index import DTYPES, INDEX, CheckpointIndex
from moectl.models.shape_build import (
    build_from_config,
    is_routed_expert,
    parameter_counts,
    shape_config,
    state_tensors,
)
from moectl.models.shape_layout import checkpoint_pieces
from moectl.models.shape_values import value_chunks

MARKER = "moectl_shape.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # Hugging Face's "5GB"
TOKENIZER_NOTE = "none: read with moectl's ByteTokenizer (UTF-8 bytes as ids 3..258, pad 0, bos 1, eos 2)"
_SAFETENSORS_DTYPES = {dtype: name for name, dtype in DTYPES.items()}  # the header's dtype names


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of the checkpoint: released name, shape, dtype, whether a routed expert's."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    routed_expert: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def plan_tensors(meta_model: torch.nn.Module) -> list[PlannedTensor]:
    """Every released-checkpoint tensor of a (meta) model, in model order."""
    model_type = meta_model.config.model_type
    return [
        PlannedTensor(piece.key, piece.shape, tensor.dtype, is_routed_expert(name))
        for name, tensor in state_tensors(meta_model)
        for piece in checkpoint_pieces(model_type, name, tuple(tensor.shape))
    ]


def plan_shards(tensors: list[PlannedTensor], max_shard_bytes: int) -> list[list[PlannedTensor]]:
    """Consecutive tensors grouped into shards of at most ``max_shard_bytes`` (a bigger tensor alone)."""
    if max_shard_bytes <= 0:
        raise ConfigError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards


def shard_name(index: int, count: int) -> str:
    """Hugging Face's shard file name, 1-based: ``model-00001-of-00003.safetensors``."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def safetensors_header(tensors: list[PlannedTensor]) -> bytes:
    """The 8-byte length and JSON header of a safetensors file holding ``tensors`` in order."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for tensor in tensors:
        header[tensor.key] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


def _write_shard(path: Path, tensors: list[PlannedTensor], seed: int) -> int:
    with open(path, "wb") as out:
        out.write(safetensors_header(tensors))
        for tensor in tensors:
            for _, block in value_chunks(tensor.key, tensor.shape, tensor.dtype, seed):
                out.write(block.reshape(-1).view(torch.uint8).numpy())
        out.flush()
        os.fsync(out.fileno())
    return path.stat().st_size


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _place(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished folder into place (replacing ``out`` only when ``overwrite``)."""
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise OutputExistsError(f"{out} exists and is not empty; pass overwrite=True to replace it")
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    _fsync_dir(out.parent)


def _summary(
    config: PretrainedConfig,
    meta: torch.nn.Module,
    tensors: list[PlannedTensor],
    shards: int,
    dtype: torch.dtype,
    seed: int,
) -> dict:
    """What a checkpoint holds: written to its marker and returned by the writer."""
    return {
        "spec": config.moectl_shape,
        "model_type": config.model_type,
        "architecture": type(meta).__name__,
        "num_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "dtype": str(dtype).removeprefix("torch."),
        "seed": seed,
        "shards": shards,
        "tensors": len(tensors),
        "tensor_bytes": sum(t.nbytes for t in tensors),
        "expert_bytes": sum(t.nbytes for t in tensors if t.routed_expert),
        "non_expert_bytes": sum(t.nbytes for t in tensors if not t.routed_expert),
        "largest_tensor_bytes": max(t.nbytes for t in tensors),
        "parameters": {k: v for k, v in parameter_counts(meta).items() if k != "bytes"},
        "layout": "Hugging Face sharded safetensors; routed experts one tensor per expert and "
        "projection, named as the family's released checkpoints",
        "tokenizer": TOKENIZER_NOTE,
    }


def _temporary_folder_beside(out: Path) -> Path:
    """An empty folder next to ``out`` (same file system, so the final rename is atomic)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    # mkdtemp makes it private; the checkpoint gets the usual mode, the umask read without setting it
    # (os.umask(0) for a moment would race with other threads creating files)
    tmp.chmod(default_mode(directory=True))
    return tmp


def write_shape_checkpoint(
    spec: str,
    out_dir: str | Path,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    overwrite: bool = False,
) -> dict:
    """Write ``spec`` (``shape:NAME[@LAYERS][~wWIDTH]``) to ``out_dir``; return a summary.

    The weights are those ``build_shape(spec, dtype=dtype, device="cpu", seed=seed)`` holds.
    Refuses a non-empty ``out_dir`` unless ``overwrite``, and a disk without room for the shards.
    """
    started = time.perf_counter()
    out = Path(out_dir).expanduser().resolve()
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise OutputExistsError(f"{out} exists and is not empty; pass overwrite=True to replace it")
    config = shape_config(spec)
    meta = build_from_config(config, dtype=dtype, device="meta")
    tensors = plan_tensors(meta)
    shards = plan_shards(tensors, max_shard_bytes)
    tensor_bytes = sum(t.nbytes for t in tensors)
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if tensor_bytes > free:
        raise UnavailableError(
            f"{config.moectl_shape} needs {tensor_bytes / 2**30:.2f} GiB but {out.parent} has "
            f"{free / 2**30:.2f} GiB free"
        )
    summary = _summary(config, meta, tensors, len(shards), dtype, seed)
    tmp = _temporary_folder_beside(out)
    try:
        config.architectures = [type(meta).__name__]
        config.dtype = dtype
        config.save_pretrained(tmp)
        make_portable(tmp)  # the config keys other loaders read (io/portable_config.py)
        weight_map: dict[str, str] = {}
        file_bytes = 0
        for index, shard in enumerate(shards, start=1):
            name = shard_name(index, len(shards))
            file_bytes += _write_shard(tmp / name, shard, seed)
            weight_map.update((t.key, name) for t in shard)
        index_json = {
            "metadata": {"total_size": tensor_bytes},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (tmp / INDEX).write_text(json.dumps(index_json, indent=2) + "\n")
        summary["bytes"] = file_bytes
        (tmp / MARKER).write_text(json.dumps(summary, indent=2) + "\n")
        _fsync_dir(tmp)
        _place(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {**summary, "path": str(out), "seconds": round(time.perf_counter() - started, 3)}


def make_checkpoint(spec: str, out: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, **options) -> dict:
    """Entry point for ``moectl checkpoint make``: write ``spec`` to ``out`` and return the summary.

    The summary has ``bytes`` (files), ``shards``, ``tensors``, ``parameters`` (``total``,
    ``active`` per token, ``active_without_embedding``, ``routed_experts``, ``non_expert``) and
    ``expert_bytes`` / ``non_expert_bytes``. ``options``: ``seed``, ``dtype``, ``overwrite``.
    """
    return write_shape_checkpoint(spec, out, max_shard_bytes=max_shard_bytes, **options)


def check_checkpoint(path: str | Path) -> dict:
    """Verify a checkpoint folder (sharded, or one ``model.safetensors``): every shard the index
    names exists, holds the tensors the index puts in it and has the size its header promises.
    Raises ``ValueError`` naming the bad file. The headers are read by ``safetensors_index``."""
    index = CheckpointIndex(Path(path))
    files = index.files
    return {"shards": len(files), "tensors": len(index), "bytes": sum(f.stat().st_size for f in files)}
