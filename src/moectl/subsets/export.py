"""Export a subset as a smaller checkpoint that plain ``transformers`` loads (no moectl import).

``slice_experts`` removes the other experts from the weights, router rows, router bias and
score-correction buffers, and sets the config's expert count; the result's outputs equal the full
model's under ``ExpertMask(keep, renorm="pruned")``. transformers configs hold one expert count,
so every MoE layer keeps the same number; grouped routers keep the same number per group (≥ 2).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from torch import nn

from moectl.adapters.inspect import ModelInfo, inspect
from moectl.adapters.slicing import check_keep, slice_experts
from moectl.errors import ConfigError
from moectl.io.atomic import atomic_dir, remove_stale_tmps
from moectl.io.portable_config import make_portable
from moectl.subsets.card import write_subset_card

METADATA = "moectl_subset.json"


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (tied weights counted once)."""
    seen = {p.data_ptr(): p.numel() for p in model.parameters()}
    return sum(seen.values())


def tensor_bytes(model: nn.Module) -> int:
    """Bytes of the distinct parameters and persistent buffers (what a checkpoint stores)."""
    tensors = {t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}
    return sum(tensors.values())


def disk_bytes(path: str | Path) -> int:
    """Real size of the files under ``path``."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def export_subset(
    model: nn.Module,
    keep: Mapping[int, Sequence[int]],
    out_dir: str | Path,
    tokenizer=None,
    info: ModelInfo | None = None,
    metadata: dict | None = None,
    source: str | Path | None = None,
    in_place: bool = False,
) -> dict:
    """Slice ``model`` to ``keep`` and save it to ``out_dir``; returns the size report.

    The model is deep-copied first unless ``in_place``. ``source`` (the checkpoint directory the
    model came from) adds its real size on disk to the report. Writes ``moectl_subset.json``
    (kept experts, ``metadata``, the report) and a model card of the subset (``README.md``,
    :mod:`moectl.subsets.card`) beside the weights. ``out_dir`` must not exist or be
    empty (as for the streamed export: an existing checkpoint, or the source itself, is never written
    into); the folder appears complete or not at all (``moectl.io.atomic.atomic_dir``, locked: a second
    export into the same folder meanwhile is refused). First removes the temporary folders that
    exports killed mid-way left beside ``out_dir`` (``remove_stale_tmps``: never a live export's),
    listed in the report's ``stale_removed``.
    """
    out_dir = Path(out_dir)
    check_out_dir(out_dir)
    stale = remove_stale_tmps(out_dir)
    info = info or inspect(model)
    keep = check_keep(info, keep)
    before = {"parameters": count_parameters(model), "tensor_bytes": tensor_bytes(model)}
    if source is not None and Path(source).is_dir():
        before["disk_bytes"] = disk_bytes(source)
    experts_before = {layer.index: layer.num_experts for layer in info.layers}
    target = model if in_place else copy.deepcopy(model)
    if not in_place:
        info = inspect(target)
    slice_experts(target, keep, info)
    if out_dir.exists():
        out_dir.rmdir()  # empty (checked): atomic_dir renames the complete folder into its place
    with atomic_dir(out_dir, overwrite=False, lock=True) as tmp:
        target.save_pretrained(tmp)
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(tmp)
        make_portable(tmp)  # the config keys and tokenizer class other loaders read (io/portable_config.py)
        after = {
            "parameters": count_parameters(target),
            "tensor_bytes": tensor_bytes(target),
            "disk_bytes": disk_bytes(tmp),
        }
        report = {
            "out": str(out_dir),
            "experts_before": experts_before,
            "experts_after": len(next(iter(keep.values()))),
            "before": before,
            "after": after,
            "parameter_fraction": after["parameters"] / before["parameters"],
        }
        meta = {
            "keep": {str(k): v for k, v in sorted(keep.items())},
            **(metadata or {}),
            "report": report,
        }
        (tmp / METADATA).write_text(json.dumps(meta, indent=2) + "\n")
        write_subset_card(tmp, meta, source)
        report["stale_removed"] = [str(path) for path in stale]  # not in the metadata: this machine's
        report["disk_bytes_with_metadata"] = disk_bytes(tmp)
    return report


def check_out_dir(out_dir: str | Path) -> Path:
    """``ValueError`` unless ``out_dir`` is a new or empty folder: an export never writes into an
    existing checkpoint (its shards would mix with the new ones) or into the folder it reads."""
    out_dir = Path(out_dir).expanduser()
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ConfigError(f"{out_dir} exists and is not an empty folder: give a new --out folder")
    return out_dir
