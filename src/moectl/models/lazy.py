"""Build a checkpoint's model on the meta device and load only what is asked: the skeleton.

Issues 13 and 18 (serve a model larger than RAM) and docs/architecture.md "Memory by design": the model is
built on meta (no memory), every non-expert parameter and persistent buffer is read from the
checkpoint's shards straight into its final tensor, the non-persistent buffers (rotary
``inv_freq``) are computed on the real device as ``from_pretrained`` computes them, and the fused
expert parameters stay on meta — the expert-offloading runtime reads them on demand from the
same shards through the returned ``ShardReader``. Peak memory is the non-expert bytes, not the
checkpoint::

    from moectl.models.lazy import load_skeleton
    model, reader = load_skeleton("/ckpt/olmoe")           # experts on meta, the rest loaded
    reader.read_expert(0, 7, out=slot)                      # one expert of MoE layer 0, on demand
    full, _ = load_skeleton("/ckpt/olmoe", load_experts=True)   # == from_pretrained, tensor for tensor

Tied weights stay tied (one tensor under every name). The model is in eval mode; a model whose
experts are still on meta cannot run a forward (or ``.to()``) until the runtime has replaced
them. The values are ``AutoModelForCausalLM.from_pretrained(path, dtype=...)``'s, bit for bit
(same class, same dtype plan, same conversion mapping, same buffer init).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from transformers import GenerationConfig, PreTrainedModel

from moectl.io.range_read import DEFAULT_READ_METHOD
from moectl.io.shards import ShardReader
from moectl.models.meta_buffers import materialize_buffers
from moectl.models.meta_model import build_meta, load_config, set_tensor


class Skeleton(NamedTuple):
    """The model (experts on meta unless loaded) and the reader of its checkpoint's shards."""

    model: PreTrainedModel
    reader: ShardReader


def _meta_tensor(model: torch.nn.Module, name: str) -> torch.Tensor:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    return module._parameters[leaf] if leaf in module._parameters else module._buffers[leaf]


def _read(reader: ShardReader, name: str, like: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Tensor ``name`` in ``like``'s dtype on ``device``, read straight into its final memory on CPU."""
    host = torch.empty(like.shape, dtype=like.dtype, pin_memory=device.type == "cuda")
    reader.read_tensor(name, out=host)
    return host if device.type == "cpu" else host.to(device, non_blocking=False)


def _generation_config(model: PreTrainedModel, folder: Path) -> None:
    if (folder / "generation_config.json").is_file() and model.can_generate():
        model.generation_config = GenerationConfig.from_pretrained(str(folder))


@torch.no_grad()
def load_skeleton(
    path: str | Path,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    load_experts: bool = False,
    method: str = DEFAULT_READ_METHOD,
) -> Skeleton:
    """The causal LM of checkpoint folder ``path`` with its non-expert tensors loaded on ``device``.

    ``dtype``: ``None``/``"auto"`` is the checkpoint config's (as ``from_pretrained``), else a
    dtype or its name; checkpoint tensors of another float dtype are cast on the way.
    ``load_experts``: also read the fused expert parameters (the whole model, as
    ``from_pretrained`` gives it); otherwise they stay on meta. ``method``: how the reader reads
    (``moectl.io.range_read.READ_METHODS``). Raises ``ValueError`` naming the file for a
    missing or truncated shard, naming the tensor for a checkpoint that does not fit the model.
    """
    folder = Path(path).expanduser()
    device = torch.device(device)
    model = build_meta(load_config(folder), dtype)
    reader = ShardReader(folder, model, method=method)
    aliases: dict[str, list[str]] = {}
    for alias, name in reader.map.tied.items():
        aliases.setdefault(name, []).append(alias)
    for name in reader.map.sources:
        if reader.is_expert(name) and not load_experts:
            continue
        set_tensor(model, name, _read(reader, name, _meta_tensor(model, name), device))
        for alias in aliases.get(name, ()):
            set_tensor(model, alias, _meta_tensor(model, name))  # the same Parameter: tied stays tied
    materialize_buffers(model, device)
    model.config.name_or_path = str(folder)
    _generation_config(model, folder)
    return Skeleton(model.eval(), reader)


def checkpoint_reader(
    path: str | Path, dtype: torch.dtype | str | None = None, method: str = DEFAULT_READ_METHOD
) -> ShardReader:
    """A ``ShardReader`` for the checkpoint folder ``path``, its model built on meta from its config
    (nothing loaded). Here, not in ``io/shards.py``: building the model is ``models/``'s job."""
    return ShardReader(path, build_meta(load_config(path), dtype), method)
