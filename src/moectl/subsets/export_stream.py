"""Export an expert subset of a checkpoint folder shard by shard, never holding the model.

Issue 13.3: ``moectl subset export`` of a checkpoint larger than memory. ``export_subset`` loads
the model, slices it and saves it; this path works on the checkpoint's tensors instead and holds
at most one output shard (≤ the largest input shard) at a time:

- the model is built on the meta device (shapes only) to know, by transformers' own
  weight-conversion mapping (``moectl.io.checkpoint_map``), which checkpoint tensors make
  each expert of each MoE layer, and which tensors carry an expert dimension (router rows,
  router bias, score-correction bias: ``moectl.adapters.slicing.per_expert_tensors``);
- a per-expert checkpoint tensor (``...experts.E.gate_proj.weight``) of a kept expert is copied
  under its new expert number, one of a dropped expert is left out; a tensor holding every
  expert (a fused checkpoint's ``experts.gate_up_proj``, a router's ``weight``) is sliced along
  its expert dimension; every other tensor is copied byte for byte;
- tensors are read with ``O_DIRECT`` into their own buffers (the page cache stays flat) and each
  input shard becomes one output shard, written atomically; the folder appears only when
  complete (``config.json`` with the new expert count, the index, tokenizer and other files).

The result is what ``export_subset`` writes, tensor for tensor (tested): plain transformers
loads it, and it equals the full model under ``ExpertMask(keep, renorm="pruned")``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections import defaultdict
from collections.abc import Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from moectl.adapters.inspect import inspect
from moectl.adapters.linear_gate import GateRouter
from moectl.adapters.slicing import EXPERT_COUNT_KEYS, check_keep, per_expert_tensors
from moectl.errors import FileFormatError
from moectl.io.atomic import atomic_dir, default_mode, remove_stale_tmps
from moectl.io.portable_config import make_portable
from moectl.io.range_read import RangeReader
from moectl.io.safetensors_index import INDEX, SINGLE, CheckpointIndex, TensorEntry
from moectl.io.shards import ShardReader
from moectl.models.meta_model import build_meta, load_config
from moectl.subsets.card import write_subset_card
from moectl.subsets.export import check_out_dir

METADATA = "moectl_subset.json"


@dataclass(frozen=True)
class _Action:
    """What becomes of one checkpoint tensor: copied as ``out_key``, or sliced along ``dim``."""

    out_key: str
    dim: int | None = None  # expert dim to slice, None for a whole copy
    ids: tuple[int, ...] = ()


def _renumber(key: str, old: int, new: int) -> str:
    pattern = re.compile(rf"(\.experts\.){old}(\.)")
    if not pattern.search(key):
        raise FileFormatError(f"{key}: a per-expert tensor whose name does not hold '.experts.{old}.'")
    return pattern.sub(rf"\g<1>{new}\g<2>", key, count=1)


def plan_actions(
    folder: Path, keep: Mapping[int, Sequence[int]]
) -> tuple[dict[str, _Action], dict, int, dict[int, int]]:
    """Per checkpoint key, what the export does with it; the checked keep lists; the kept expert
    count; the experts per MoE layer before."""
    meta = build_meta(load_config(folder))
    info = inspect(meta)
    for layer in info.layers:
        if isinstance(layer.router, GateRouter):
            raise FileFormatError(
                f"MoE layer {layer.index} ({layer.adapter.family}) holds its experts as a list of modules: "
                "export it from a loaded model (moectl subset export without streaming)"
            )
    keep = check_keep(info, keep)
    reader = ShardReader(folder, meta)
    actions: dict[str, _Action] = {}
    for name, tensor in per_expert_tensors(meta, info).items():
        source = reader.map[reader.map.tied.get(name, name)]
        ids = keep[tensor.layer]
        if source.entry is not None:  # one checkpoint tensor holds every expert: slice it
            shape, n = source.entry.shape, info.layers[tensor.layer].num_experts
            if len(shape) <= tensor.dim or shape[tensor.dim] != n:
                raise FileFormatError(
                    f"{source.entry.key}: {list(shape)} has no dimension {tensor.dim} of {n} experts"
                )
            actions[source.entry.key] = _Action(source.entry.key, tensor.dim, tuple(ids))
            continue
        new_of = {old: new for new, old in enumerate(ids)}
        for expert in range(source.num_experts):
            for segment in source.segments(expert):
                if expert in new_of:
                    actions[segment.key] = _Action(_renumber(segment.key, expert, new_of[expert]))
                else:
                    actions[segment.key] = _Action("")  # dropped
    reader.close()
    before = {layer.index: layer.num_experts for layer in info.layers}
    return actions, keep, len(next(iter(keep.values()))), before


def _read(io: RangeReader, entry: TensorEntry) -> Tensor:
    out = torch.empty(entry.shape, dtype=entry.dtype)
    if entry.nbytes:
        io.read(entry.file, [(entry.offset, memoryview(out.reshape(-1).view(torch.uint8).numpy()))])
    return out


def _disk_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _config(folder: Path, out: Path, experts: int) -> None:
    config = json.loads((folder / "config.json").read_text())
    sections = [config, *(v for v in config.values() if isinstance(v, dict))]  # text_config & co
    found = False
    for section in sections:
        for key in EXPERT_COUNT_KEYS:
            if key in section:
                section[key] = experts
                found = True
    if not found:
        raise FileFormatError(f"{folder / 'config.json'} names no expert count ({', '.join(EXPERT_COUNT_KEYS)})")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _copy_side_files(folder: Path, out: Path) -> None:
    """Tokenizer, generation config, remote code and the like: every file but weights and index."""
    for path in folder.iterdir():
        if (
            path.is_file()
            and path.suffix != ".safetensors"
            and path.name not in (INDEX, "config.json", METADATA)
        ):
            shutil.copy2(path, out / path.name)


def export_checkpoint_subset(
    folder: str | Path,
    keep: Mapping[int, Sequence[int]],
    out_dir: str | Path,
    metadata: dict | None = None,
) -> dict:
    """Write the subset ``keep`` of checkpoint ``folder`` to ``out_dir`` shard by shard; the report.

    ``out_dir`` must not exist or be empty. Raises ``ValueError`` naming what is wrong (a keep list
    the model refuses, a checkpoint that does not fit its config) before anything is written. As
    ``export_subset``: a locked write, after removing what killed exports left beside ``out_dir``
    (the report's ``stale_removed``).
    """
    folder, out_dir = Path(folder).expanduser(), Path(out_dir).expanduser()
    check_out_dir(out_dir)
    actions, keep, experts, experts_before = plan_actions(folder, keep)
    stale = remove_stale_tmps(out_dir)  # killed exports' .tmp-* folders beside out_dir, never a live one's
    index = CheckpointIndex(folder)
    by_file: dict[Path, list[str]] = defaultdict(list)
    for key, entry in index.entries.items():
        by_file[entry.file].append(key)
    files = sorted(by_file)
    if out_dir.exists():
        out_dir.rmdir()  # empty (checked): atomic_dir renames the complete folder into its place
    io = RangeReader("direct")
    weight_map: dict[str, str] = {}
    before = after = params_before = params_after = 0
    with closing(io), atomic_dir(out_dir, overwrite=False, lock=True) as tmp:
        for i, file in enumerate(files):
            name = SINGLE if len(files) == 1 else f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            tensors: dict[str, Tensor] = {}
            for key in sorted(by_file[file], key=lambda k: index[k].offset):
                entry = index[key]
                before += entry.nbytes
                params_before += entry.nbytes // entry.dtype.itemsize
                action = actions.get(key, _Action(key))
                if not action.out_key:
                    continue
                tensor = _read(io, entry)
                if action.dim is not None:
                    tensor = tensor.index_select(action.dim, torch.tensor(action.ids)).contiguous()
                tensors[action.out_key] = tensor
                weight_map[action.out_key] = name
                after += tensor.numel() * tensor.element_size()
                params_after += tensor.numel()
            save_file(tensors, str(tmp / name), metadata={"format": "pt"})
            (tmp / name).chmod(default_mode())  # safetensors writes 0600; a checkpoint is readable as any file
            del tensors
        if len(files) > 1:
            index_json = {"metadata": {"total_size": after}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX).write_text(json.dumps(index_json, indent=2) + "\n")
        _config(folder, tmp, experts)
        _copy_side_files(folder, tmp)
        make_portable(tmp)  # the config keys and tokenizer class other loaders read (io/portable_config.py)
        report = {
            "out": str(out_dir),
            "streamed": True,
            "experts_before": experts_before,
            "experts_after": experts,
            "before": {
                "parameters": params_before,
                "tensor_bytes": before,
                "disk_bytes": _disk_bytes(folder),
            },
            "after": {"parameters": params_after, "tensor_bytes": after, "disk_bytes": _disk_bytes(tmp)},
            "parameter_fraction": params_after / params_before if params_before else None,
        }
        meta = {"keep": {str(k): v for k, v in sorted(keep.items())}, **(metadata or {}), "report": report}
        (tmp / METADATA).write_text(json.dumps(meta, indent=2) + "\n")
        write_subset_card(tmp, meta, folder)  # replaces the parent's card copied above
        report["stale_removed"] = [str(path) for path in stale]  # not in the metadata: this machine's
        report["disk_bytes_with_metadata"] = _disk_bytes(tmp)
        os.chmod(tmp, default_mode(directory=True))
    return report
