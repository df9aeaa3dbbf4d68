"""Which checkpoint tensors make each tensor of a transformers model, and where each one lands.

transformers 5 keeps a layer's experts fused (``experts.gate_up_proj`` [E, 2I, H], ``down_proj``
[E, H, I]); released checkpoints mostly keep one tensor per expert and projection, and
transformers fuses them at load with the model's *weight-conversion mapping*
(``transformers.conversion_mapping.get_model_conversion_mapping``: renamings such as Mixtral's
``block_sparse_moe`` -> ``mlp``, then converters such as ``MergeModulelist(dim=0)`` +
``Concatenate(dim=1)`` for gate and up). This module asks transformers for that mapping and runs
its own key renaming (``core_model_loading.rename_source_key``) over the checkpoint's names, so
every family transformers knows is handled without a table of ours; it then turns each
converter's operations into placements, so that expert ``e`` of a fused parameter is a short
list of byte ranges of the checkpoint:

- **per expert** (OLMoE, Qwen2/3-MoE, DeepSeek, Mixtral, Phi-MoE releases): expert ``e`` of
  ``gate_up_proj`` is the gate tensor of expert ``e`` (rows ``0..I``) then its up tensor (rows
  ``I..2I``), each one contiguous range;
- **fused** (gpt-oss releases, ``save_pretrained(save_original_format=False)``): the checkpoint
  tensor has the model's shape and expert ``e`` is its ``e``-th slice, one contiguous range.

Operations other than renaming, ``MergeModulelist(dim=0)`` and ``Concatenate`` raise
``NotImplementedError`` naming the tensor; a missing checkpoint tensor, a shape that does not
fit or a dtype of the wrong kind raise ``ValueError`` naming it.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    Concatenate,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
    dot_natural_key,
    rename_source_key,
)

from moectl.errors import FileFormatError
from moectl.io.safetensors_index import CheckpointIndex, TensorEntry

Index = tuple[int | slice, ...]


@dataclass(frozen=True)
class Segment(TensorEntry):
    """A contiguous byte range of one checkpoint tensor (a :class:`TensorEntry`: file, offset, length,
    dtype, shape) and where it lands in a destination tensor.

    ``index`` places it inside the destination (the expert's slice when reading an expert, the
    whole model tensor otherwise); ``()`` is the whole destination.
    """

    index: Index = ()


def _whole(entry: TensorEntry, index: Index = ()) -> Segment:
    return Segment(entry.key, entry.file, entry.offset, entry.nbytes, entry.dtype, entry.shape, index)


@dataclass(frozen=True)
class TensorSource:
    """Where one model tensor comes from: one checkpoint tensor of its shape (``whole``; for a fused
    expert parameter stored fused, expert ``e`` is its ``e``-th slice) or pieces of per-expert
    checkpoint tensors (``per_expert``)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: str  # "whole" (one checkpoint tensor of the model's shape) | "per_expert"
    entry: TensorEntry | None = None  # "whole": the checkpoint tensor
    experts: tuple[tuple[tuple[TensorEntry, Index], ...], ...] = ()  # "per_expert": per expert

    @property
    def num_experts(self) -> int:
        return len(self.experts) if self.layout == "per_expert" else self.shape[0]

    def segments(self, expert: int | None = None) -> list[Segment]:
        """The byte ranges of the whole tensor (``expert=None``) or of slice ``expert`` of dim 0."""
        if expert is None:
            if self.entry is not None:
                return [_whole(self.entry)]
            return [_whole(e, (i, *index)) for i, pieces in enumerate(self.experts) for e, index in pieces]
        if not 0 <= expert < self.num_experts:
            raise IndexError(f"{self.name}: expert {expert} out of range (0..{self.num_experts - 1})")
        if self.entry is not None:
            entry, row = self.entry, self.entry.row_bytes
            return [
                Segment(entry.key, entry.file, entry.offset + expert * row, row, entry.dtype, entry.shape[1:])
            ]
        return [_whole(e, index) for e, index in self.experts[expert]]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments())


@dataclass
class CheckpointMap:
    """Every model tensor's source; ``tied`` maps an alias (a tied weight) to the name it shares."""

    sources: dict[str, TensorSource]
    tied: dict[str, str] = field(default_factory=dict)
    unused: list[str] = field(default_factory=list)  # checkpoint tensors no model tensor takes

    def __getitem__(self, name: str) -> TensorSource:
        return self.sources[self.tied.get(name, name)]


def model_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(name -> tensor of every parameter, once, and persistent buffer; alias -> name of tied ones)."""
    tensors: dict[str, torch.Tensor] = {}
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied[name] = first[id(param)]
        else:
            first[id(param)] = name
            tensors[name] = param
    for module_name, module in model.named_modules():
        for leaf, buffer in module.named_buffers(recurse=False):
            if buffer is not None and leaf not in module._non_persistent_buffers_set:
                tensors[f"{module_name}.{leaf}" if module_name else leaf] = buffer
    return tensors, tied


def _expert_number(pattern: str) -> re.Pattern[str] | None:
    """A regex capturing the expert number where ``*`` stands in a converter's source pattern."""
    if "*" not in pattern:
        return None
    return re.compile(re.escape(pattern).replace(r"\*", r"(\d+)"))


def _placements(converter: WeightConverter, name: str) -> int | None:
    """The dimension of an expert's slice along which the sources are concatenated (None: one source)."""
    ops = list(converter.operations)
    merge_first = ops and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
    if merge_first and len(ops) == 1 and len(converter.source_patterns) == 1:
        return None
    if merge_first and len(ops) == 2 and isinstance(ops[1], Concatenate) and ops[1].dim >= 1:
        return ops[1].dim - 1
    raise NotImplementedError(
        f"{name}: transformers builds it from {converter.source_patterns} with {ops}; moectl's shard reader "
        "handles renamings, MergeModulelist(dim=0) and MergeModulelist(dim=0) + Concatenate only"
    )


def _per_expert(
    name: str,
    tensor: torch.Tensor,
    converter: WeightConverter,
    found: dict[str, list[str]],
    renamed: dict[str, str],
    index: CheckpointIndex,
) -> TensorSource:
    """A fused [E, ...] model tensor assembled from one checkpoint tensor per expert and source."""
    shape = tuple(tensor.shape)
    num_experts, slice_shape = shape[0], shape[1:]
    dim = _placements(converter, name)
    experts: list[list[tuple[TensorEntry, Index]]] = [[] for _ in range(num_experts)]
    start = 0
    for pattern in converter.source_patterns:
        keys = sorted(found.get(pattern, []), key=dot_natural_key)
        number = _expert_number(pattern)
        numbers = list(range(len(keys)))
        if number is not None:
            matches = [number.search(renamed[key]) for key in keys]
            if all(matches):
                numbers = [int(m.group(1)) for m in matches]  # type: ignore[union-attr]
        if sorted(numbers) != list(range(num_experts)):
            absent = sorted(set(range(num_experts)) - set(numbers))
            raise FileFormatError(
                f"model tensor {name} needs {num_experts} checkpoint tensors matching {pattern!r}, found "
                f"{len(keys)}" + (f" (expert {absent[0]} is missing)" if absent else "")
            )
        shapes = Counter(index[key].shape for key in keys)
        piece = shapes.most_common(1)[0][0]
        odd = next((key for key in keys if index[key].shape != piece), None)
        if odd is not None:
            raise FileFormatError(
                f"checkpoint tensor {odd} has shape {list(index[odd].shape)}, the other experts' {pattern!r} "
                f"tensors {list(piece)} (model tensor {name})"
            )
        width = piece[dim] if dim is not None and len(piece) == len(slice_shape) else 0
        if dim is None:
            fits = piece == slice_shape
        else:
            others = [d for d in range(len(slice_shape)) if d != dim]
            fits = len(piece) == len(slice_shape) and all(piece[d] == slice_shape[d] for d in others)
            fits = fits and start + width <= slice_shape[dim]
        if not fits:
            along = "" if dim is None else f" (its sources concatenated along dimension {dim})"
            raise FileFormatError(
                f"checkpoint tensor {keys[0]} has shape {list(piece)}; model tensor {name} {list(shape)} takes "
                f"{list(slice_shape)} per expert{along}"
            )
        place: Index = () if dim is None else (*(slice(None),) * dim, slice(start, start + width))
        for key, e in zip(keys, numbers, strict=True):
            experts[e].append((index[key], place))
        start += width
    if dim is not None and start != slice_shape[dim]:
        raise FileFormatError(
            f"model tensor {name} {list(shape)}: its checkpoint tensors fill {start} of {slice_shape[dim]} "
            f"along dimension {dim + 1}"
        )
    return TensorSource(name, shape, tensor.dtype, "per_expert", experts=tuple(tuple(p) for p in experts))


def _check_dtype(name: str, tensor: torch.Tensor, entries: list[TensorEntry]) -> None:
    for entry in entries:
        if entry.dtype.is_floating_point != tensor.dtype.is_floating_point:
            raise FileFormatError(
                f"checkpoint tensor {entry.key} is {entry.dtype}; model tensor {name} is {tensor.dtype}, "
                "which it cannot be cast to (a quantised or mismatched checkpoint?)"
            )


def map_checkpoint(model: nn.Module, index: CheckpointIndex) -> CheckpointMap:
    """Map every parameter and persistent buffer of ``model`` (any device, meta included) to the
    checkpoint tensors transformers would load into it, through the model's conversion mapping."""
    tensors, tied = model_tensors(model)
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    targets = {**{alias: tensors[name] for alias, name in tied.items()}, **tensors}
    prefix = getattr(model, "base_model_prefix", None)
    plain: dict[str, list[str]] = defaultdict(list)
    fused: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    renamed: dict[str, str] = {}
    unused: list[str] = []
    for key in sorted(index.keys(), key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, prefix, targets)
        if target not in targets and key in targets:
            target, pattern = key, None
        if target not in targets:
            unused.append(key)
            continue
        target = tied.get(target, target)
        if pattern is None:
            plain[target].append(key)
        else:
            renamed[key] = _apply_renamings(key, renamings)
            fused[target][pattern].append(key)
    sources: dict[str, TensorSource] = {}
    for name, tensor in tensors.items():
        shape = tuple(tensor.shape)
        if name in fused:
            converter = by_pattern[next(iter(fused[name]))]
            source = _per_expert(name, tensor, converter, fused[name], renamed, index)
            _check_dtype(name, tensor, [e for pieces in source.experts for e, _ in pieces])
        elif name in plain:
            keys = plain[name]
            if len(keys) > 1 and name in keys:  # a tied weight saved under both names
                keys = [name]
            if len(keys) > 1:
                raise FileFormatError(f"model tensor {name} is given by several checkpoint tensors: {keys}")
            entry = index[keys[0]]
            if entry.shape != shape:
                raise FileFormatError(
                    f"checkpoint tensor {entry.key} has shape {list(entry.shape)}; model tensor {name} needs {list(shape)}"
                )
            _check_dtype(name, tensor, [entry])
            source = TensorSource(name, shape, tensor.dtype, "whole", entry=entry)
        else:
            raise FileFormatError(
                f"model tensor {name} {list(shape)} is not in the checkpoint {index.root} (no tensor of that "
                "name, nor one transformers' conversion mapping turns into it)"
            )
        sources[name] = source
    return CheckpointMap(sources, tied, unused)


def _apply_renamings(key: str, renamings: list[WeightRenaming]) -> str:
    """``key`` with every renaming applied in turn (transformers' ``apply_renamings``, which its
    releases before 5.24 lack)."""
    for renaming in renamings:
        key, _ = renaming.rename_source_key(key)
    return key
