"""Subset files: the kept experts of every MoE layer, as JSON — an ``expert_mask`` policy file.

    {"type": "expert_mask", "format_version": 1, "model": "tiny:olmoe", "method": "router",
     "keep": {"0": [1, 4, 6, 7], "1": [...], ...},
     "calibration": {"data": "math_val.jsonl", "documents": 5, "tokens": 812, ...}}

A subset file is the expert mask of EMO §4.2 with provenance (model, method, calibration), so
``moectl.load_policy``, ``route()``, ``moectl eval --policy`` and ``moectl serve-offload
--policy`` take it as it is. Files written before the type existed (no ``type``) and policy
files that spell the lists ``experts`` load here too.

Keys of ``keep`` are MoE layer indices (dense layers skipped), values the kept expert ids. Loading
refuses, naming the file and the layer: a missing file, a folder, unreadable or non-UTF-8 bytes,
non-JSON (``read_policy_json``, the reader ``load_policy`` uses too), missing fields, non-integer
layers or ids, duplicates; with the model's ``ModelInfo`` also a file made for another model
(another ``num_experts``, or another ``model`` than the verb's: ``routing/made_for.py``, applied
anyway under ``--force``), unknown or missing layers, out-of-range ids, fewer than top-k experts,
unequal counts and unbalanced router groups (``slicing.check_keep``). A file records the model it
was chosen on and its experts per MoE layer (``num_experts``); one applied anyway to another model
(``--force``) is named in a warning (:func:`subset_mismatch`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from moectl.adapters.inspect import ModelInfo
from moectl.adapters.slicing import check_keep
from moectl.errors import ConfigError, FileFormatError
from moectl.io.atomic import write_text_atomic
from moectl.routing.legacy import check_expert_count
from moectl.routing.made_for import check_made_for
from moectl.routing.policy_config import FORMAT_VERSION
from moectl.routing.policy_files import read_policy_json


@dataclass
class SubsetFile:
    keep: dict[int, list[int]]
    model: str | None = None
    method: str | None = None
    calibration: dict = field(default_factory=dict)
    num_experts: int | None = None  # experts per MoE layer of the model it was chosen on

    def to_json(self) -> dict:
        return {
            "type": "expert_mask",
            "format_version": FORMAT_VERSION,
            "model": self.model,
            "num_experts": self.num_experts,
            "method": self.method,
            "keep": {str(layer): list(ids) for layer, ids in sorted(self.keep.items())},
            "calibration": self.calibration,
        }


def save_subset(
    path: str | Path,
    keep: Mapping[int, Sequence[int]],
    model: str | None = None,
    method: str | None = None,
    calibration: dict | None = None,
    num_experts: int | None = None,
) -> Path:
    """Write a subset file (parent folders created, atomically); returns its path. ``num_experts``:
    the experts per MoE layer of the model it was chosen on (recorded for :func:`subset_mismatch`)."""
    subset = SubsetFile(
        {int(k): sorted(int(i) for i in v) for k, v in keep.items()},
        model,
        method,
        calibration or {},
        num_experts,
    )
    return write_text_atomic(path, json.dumps(subset.to_json(), indent=2) + "\n")


def load_subset(path: str | Path, info: ModelInfo | None = None) -> SubsetFile:
    """Read and validate a subset file; with ``info``, also against the model. A ``MoectlError``
    (a ``ValueError`` or ``FileNotFoundError``) naming the file and the problem."""
    path = Path(path)
    data = read_policy_json(path, "subset file")
    if isinstance(data, dict) and data.get("type", "expert_mask") != "expert_mask":
        raise FileFormatError(f"subset file {path}: a policy of type {data['type']!r}, not an expert_mask")
    if isinstance(data, dict) and "keep" not in data and "experts" in data:  # a policy file's spelling
        data = {**data, "keep": data["experts"]}
    if isinstance(data, dict) and "keep" not in data and "everywhere" in data and info is not None:
        data = {**data, "keep": {str(layer.index): data["everywhere"] for layer in info.layers}}
    if not isinstance(data, dict) or not isinstance(data.get("keep"), dict) or not data["keep"]:
        raise FileFormatError(f'subset file {path}: needs a "keep" object mapping MoE layer -> list of expert ids')
    keep: dict[int, list[int]] = {}
    for key, ids in data["keep"].items():
        try:
            layer = int(key)
        except ValueError:
            raise FileFormatError(
                f"subset file {path}: layer key {key!r} is not an integer MoE layer index"
            ) from None
        if layer in keep:
            raise FileFormatError(f"subset file {path}: MoE layer {layer} is listed twice")
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise FileFormatError(
                f"subset file {path}: MoE layer {layer}: keep must be a list of integer expert ids"
            )
        if len(set(ids)) != len(ids):
            dupes = sorted({i for i in ids if ids.count(i) > 1})
            raise FileFormatError(f"subset file {path}: MoE layer {layer}: duplicate experts {dupes}")
        if any(i < 0 for i in ids):
            raise FileFormatError(f"subset file {path}: MoE layer {layer}: negative expert ids in {ids}")
        keep[layer] = sorted(ids)
    if info is not None:
        check_made_for(data, path, info)  # another model: its ids name other experts (--force: apply anyway)
        try:
            keep = check_keep(info, keep)
        except ValueError as err:
            raise ConfigError(f"subset file {path} does not fit the model: {err}") from None
    calibration = data.get("calibration") or {}
    if not isinstance(calibration, dict):
        raise FileFormatError(f'subset file {path}: "calibration" must be an object')
    check_expert_count(data, path)  # a positive integer or null
    return SubsetFile(keep, data.get("model"), data.get("method"), calibration, data.get("num_experts"))


def subset_mismatch(path: str | Path, subset: SubsetFile, model: str | None, info: ModelInfo) -> str | None:
    """A one-line warning when ``subset`` (read from ``path``) records another model name than ``model``
    (its spec). Another expert count than ``info``'s is no warning but an error, in :func:`load_subset`."""
    if subset.model is None or model is None or subset.model == model:
        return None
    return f"{path} was chosen on {subset.model}, used on {model} ({info.num_experts} experts per MoE layer)"
