"""Read a model's experts on demand straight from its checkpoint's safetensors shards.

Issues 13 and 18: serve a model larger than RAM. ``serve-offload`` used to load the whole model
and rewrite every expert into a second store (peak RSS 163% of the checkpoint for OLMoE-1B-7B);
docs/architecture.md ("Memory by design") asks instead to read offloaded experts straight from the checkpoint's
own shards, never from a second copy. A ``ShardReader`` is that reader::

    from moectl.io.shards import ShardReader
    reader = ShardReader(path, model)          # model: the same architecture, any device (meta is fine)
    reader.layers[0].module                    # "model.layers.0.mlp.experts"; MoE layer 0
    slot = reader.empty_expert(0)              # {"gate_up_proj": [2I, H], "down_proj": [H, I]}
    reader.read_expert(0, 7, out=slot)         # fills the slot in place: no other copy of expert 7
    reader.expert_segments(0, 7)               # its byte ranges: (file, offset, length, ...) per parameter
    reader.read_tensor("model.norm.weight")    # any other tensor, whole

- The index comes from the shards' headers alone (``safetensors_index``); no file is memory-mapped.
- Expert addressing follows transformers' own weight-conversion mapping (``checkpoint_map``):
  per-expert checkpoints (OLMoE, Qwen2/3-MoE, DeepSeek, Mixtral, Phi-MoE releases) and fused
  ones (gpt-oss, ``save_pretrained(save_original_format=False)``) alike.
- Reads go through ``range_read``: ``preadv`` into the destination (the resident slot) where
  dtype and layout allow, with ``method="direct"`` (O_DIRECT, default), ``"fadvise"`` or
  ``"plain"`` deciding what the page cache keeps (``benchmarks/shard_read.py`` measures them).

MoE layers are numbered as ``moectl.inspect(model).layers``: the fused experts modules (a module
named ``experts`` holding [E, ...] parameters) in model order. A checkpoint that does not fit
the model (missing tensor, wrong shape, a dtype of another kind) raises ``ValueError`` naming the
tensor when the reader is made; a missing or truncated shard raises ``ValueError`` naming the file.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from moectl.io.checkpoint_map import CheckpointMap, Segment, TensorSource, map_checkpoint
from moectl.io.range_read import DEFAULT_READ_METHOD, READ_METHODS, RangeReader, ReadStats, ShardError
from moectl.io.safetensors_index import CheckpointIndex

__all__ = ["DEFAULT_READ_METHOD", "READ_METHODS", "ExpertLayer", "Segment", "ShardReader", "expert_modules"]


@dataclass(frozen=True)
class ExpertLayer:
    """One MoE layer's fused experts: its module name and, per parameter, where it comes from."""

    index: int
    module: str
    num_experts: int
    params: dict[str, TensorSource]  # "gate_up_proj", "down_proj" (+ gpt-oss's biases) -> source

    def expert_shape(self, name: str) -> tuple[int, ...]:
        return self.params[name].shape[1:]

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert in the checkpoint."""
        return sum(s.nbytes for s in self.params.values()) // self.num_experts


def expert_modules(model: nn.Module) -> list[tuple[str, dict[str, Tensor]]]:
    """(module name, {parameter: [E, ...] tensor}) of every fused experts module, in model order."""
    found = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] != "experts":
            continue
        params = {n: p for n, p in module.named_parameters(recurse=False) if p.dim() >= 2}
        if params and len({p.shape[0] for p in params.values()}) == 1:
            found.append((name, params))
    return found


def _bytes(t: Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _tensors_hit(jobs: list[tuple[Tensor, Segment]], file: Path, err: ShardError) -> str:
    """``"; tensor NAME bytes A..B"`` for the first tensor of ``file`` the error concerns: one past the
    shard's end when it was truncated, else the first read from it."""
    segs = [seg for _, seg in jobs if seg.file == file]
    if err.size is not None:
        segs = [seg for seg in segs if seg.offset + seg.nbytes > err.size] or segs
    if not segs:
        return ""
    seg = min(segs, key=lambda s: s.offset)
    return f"; tensor {seg.key} is bytes {seg.offset}..{seg.offset + seg.nbytes}"


class ShardReader:
    """A checkpoint's tensors and per-expert byte ranges, read on demand into caller buffers.

    Also usable as an expert store (``load(layer, expert)``, ``kind``) where a fresh tensor per
    call is wanted; ``read_expert(..., out=slot)`` is the zero-extra-copy path.
    """

    kind = "checkpoint"

    def __init__(self, path: str | Path, model: nn.Module, method: str = DEFAULT_READ_METHOD) -> None:
        self.path = Path(path).expanduser()
        self.index = CheckpointIndex(self.path)
        self.map: CheckpointMap = map_checkpoint(model, self.index)
        self.layers: list[ExpertLayer] = []
        for i, (module, params) in enumerate(expert_modules(model)):
            sources = {leaf: self.map[f"{module}.{leaf}"] for leaf in params}
            num_experts = next(iter(params.values())).shape[0]
            self.layers.append(ExpertLayer(i, module, num_experts, sources))
        self.expert_names = frozenset(s.name for layer in self.layers for s in layer.params.values())
        self.io = RangeReader(method, identities=self.index.identities)

    # -- figures ----------------------------------------------------------------------------------
    @property
    def method(self) -> str:
        return self.io.method

    @property
    def stats(self) -> ReadStats:
        return self.io.stats

    @property
    def expert_bytes(self) -> int:
        """Checkpoint bytes of every routed expert parameter."""
        return sum(self.map.sources[n].nbytes for n in self.expert_names)

    @property
    def non_expert_bytes(self) -> int:
        """Checkpoint bytes of every other model tensor (tied ones once)."""
        return sum(s.nbytes for n, s in self.map.sources.items() if n not in self.expert_names)

    def is_expert(self, name: str) -> bool:
        return self.map.tied.get(name, name) in self.expert_names

    # -- addressing -------------------------------------------------------------------------------
    def _layer(self, layer: int) -> ExpertLayer:
        if not 0 <= layer < len(self.layers):
            raise IndexError(f"MoE layer {layer} out of range: the model has {len(self.layers)} MoE layers")
        return self.layers[layer]

    def expert_segments(self, layer: int, expert: int) -> dict[str, list[Segment]]:
        """Per parameter of MoE layer ``layer``, the checkpoint byte ranges of expert ``expert``
        and where each lands inside the expert's slice (``Segment.index``)."""
        return {name: source.segments(expert) for name, source in self._layer(layer).params.items()}

    def empty_expert(
        self, layer: int, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
    ) -> dict[str, Tensor]:
        """Uninitialised destination tensors for one expert of ``layer`` (the model's dtypes)."""
        params = self._layer(layer).params
        return {
            name: torch.empty(s.shape[1:], dtype=dtype or s.dtype, device=device)
            for name, s in params.items()
        }

    # -- reading ----------------------------------------------------------------------------------
    def _fill(self, jobs: list[tuple[Tensor, Segment]]) -> None:
        """Read every segment into its place in its destination; one batch of ``preadv`` per file."""
        requests: dict[Path, list[tuple[int, memoryview]]] = defaultdict(list)
        casts: list[tuple[Tensor, Tensor]] = []
        for dest, seg in jobs:
            view = dest[seg.index] if seg.index else dest
            if tuple(view.shape) != seg.shape:
                raise ValueError(
                    f"{seg.key}: lands in a {list(view.shape)} view, the checkpoint has {list(seg.shape)}"
                )
            if view.device.type == "cpu" and view.dtype == seg.dtype and view.is_contiguous():
                target = view
            else:  # another dtype or device, or a strided place: read, then copy
                target = torch.empty(seg.shape, dtype=seg.dtype)
                casts.append((view, target))
            requests[seg.file].append((seg.offset, _bytes(target)))
        for file, reqs in requests.items():
            try:
                self.io.read(file, reqs)
            except ShardError as err:
                raise ShardError(f"{err}{_tensors_hit(jobs, file, err)}", err.path, err.start, err.size) from err
        for view, target in casts:
            view.copy_(target)

    def read_expert(self, layer: int, expert: int, out: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        """Expert ``expert`` of MoE layer ``layer``: fills ``out`` (per parameter, a tensor of the
        expert's shape: the resident slot) in place, allocating any parameter ``out`` lacks."""
        params = self._layer(layer).params
        unknown = sorted(set(out or {}) - set(params))
        if unknown:
            raise KeyError(
                f"MoE layer {layer} has no expert parameter {unknown[0]!r}; it has {sorted(params)}"
            )
        out = {**self.empty_expert(layer), **(out or {})}
        jobs: list[tuple[Tensor, Segment]] = []
        for name, source in params.items():
            if tuple(out[name].shape) != source.shape[1:]:
                raise ValueError(
                    f"MoE layer {layer}, expert {expert}, {name}: destination is {list(out[name].shape)}, an expert "
                    f"of {source.name} is {list(source.shape[1:])}"
                )
            jobs += [(out[name], seg) for seg in source.segments(expert)]
        self._fill(jobs)
        return out

    def load(self, layer: int, expert: int) -> dict[str, Tensor]:
        """The expert-store interface of ``moectl.offload``: a fresh copy of one expert."""
        return self.read_expert(layer, expert)

    def read_into(self, layer: int, expert: int, dst: dict[str, Tensor]) -> None:
        """The store interface's in-place read: fill ``dst`` (a resident slot) with the expert."""
        self.read_expert(layer, expert, out=dst)

    def read_tensor(self, name: str, out: Tensor | None = None) -> Tensor:
        """Model tensor ``name`` (any parameter or persistent buffer; fused experts whole), read
        into ``out`` when given (any dtype/device: cast on the way) or a new CPU tensor."""
        try:
            source = self.map[name]
        except KeyError:
            raise KeyError(f"{name} is not a parameter or persistent buffer of the model") from None
        if out is None:
            out = torch.empty(source.shape, dtype=source.dtype)
        elif tuple(out.shape) != source.shape:
            raise ValueError(f"{name}: destination is {list(out.shape)}, the tensor is {list(source.shape)}")
        self._fill([(out, seg) for seg in source.segments()])
        return out

    def read_rows(self, name: str, rows: Sequence[int]) -> Tensor:
        """Slices ``rows`` of dim 0 of model tensor ``name`` (a subset's experts, or their router
        rows), stacked in that order: only those slices' bytes are read."""
        source = self.map[name]
        out = torch.empty((len(rows), *source.shape[1:]), dtype=source.dtype)
        self._fill([(out[i], seg) for i, row in enumerate(rows) for seg in source.segments(row)])
        return out

    def close(self) -> None:
        self.io.close()

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
