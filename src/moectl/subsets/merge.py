"""Merge fine-tuned subset experts back into the full model (EMO §6, "modular development").

EMO §6: "we finetune a 32-expert subset from EMO, then inserted it back into the original
128-expert model by replacing the corresponding experts." That is what ``merge_subset`` does by
default: the subset's experts (the experts module's weights) are written at the kept indices of
the full model and everything else stays the full model's. The paper says nothing about the
router; moectl also writes the kept experts' router rows (and router / score-correction bias),
which were fine-tuned together with the experts — a row is the expert's key — unless
``router=False``. ``all_weights=True`` goes beyond the paper: it also takes the fine-tuned weights
every expert shares (attention, norms, embeddings, shared experts), which the fine-tuned experts
were trained against, at the price of changing the other domains' computation too.

This is the inverse of ``export_subset`` (``adapters.slicing.write_experts`` undoes
``slice_experts``): merging an unchanged export gives back the full model exactly.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from moectl.adapters.inspect import ModelInfo, inspect
from moectl.adapters.slicing import check_keep, per_expert_tensors, write_experts
from moectl.errors import ConfigError
from moectl.io.portable_config import make_portable
from moectl.train.checkpoint import write_dir_atomic

METADATA = "moectl_merge.json"


@torch.no_grad()
def merge_subset(
    model: nn.Module,
    subset_model: nn.Module,
    keep: Mapping[int, Sequence[int]],
    router: bool = True,
    all_weights: bool = False,
    info: ModelInfo | None = None,
) -> dict:
    """Write ``subset_model``'s experts into ``model`` at ``keep``'s indices, in place; returns a report.

    ``router``: also the kept experts' router rows and biases. ``all_weights``: also every tensor
    that is not per-expert (beyond EMO §6). The report gives, per MoE layer, the experts written
    and the largest absolute change of their weights.
    """
    info = info or inspect(model)
    keep = check_keep(info, keep)
    parts = ("router", "experts") if router else ("experts",)
    changes = write_experts(model, subset_model, keep, parts, info)
    entries = per_expert_tensors(model, info)
    layers = {
        index: {
            "experts": ids,
            "max_change": max((c for n, c in changes.items() if entries[n].layer == index), default=0.0),
        }
        for index, ids in keep.items()
    }
    shared = _copy_shared(model, subset_model, set(entries)) if all_weights else {}
    return {
        "router": router,
        "all_weights": all_weights,
        "layers": layers,
        "expert_tensors_written": len(changes),
        "shared_tensors_written": len(shared),
        "shared_max_change": max(shared.values(), default=0.0),
    }


def _copy_shared(model: nn.Module, subset_model: nn.Module, expert_names: set[str]) -> dict[str, float]:
    """Copy every state-dict tensor of ``subset_model`` that is not per-expert; ``{name: max |change|}``."""
    source = subset_model.state_dict()
    changes: dict[str, float] = {}
    for name, target in model.state_dict().items():
        if name in expert_names:
            continue
        if name not in source:
            raise ConfigError(f"--all-weights: the subset model has no tensor {name}")
        value = source[name].to(target.device, target.dtype)
        if value.shape != target.shape:
            raise ConfigError(
                f"--all-weights: {name} is {list(value.shape)} in the subset model, {list(target.shape)} "
                "in the full model"
            )
        changes[name] = float((value - target).abs().max()) if value.numel() else 0.0
        target.copy_(value)  # state_dict tensors share storage with the model's
    return changes


def save_merged(
    model: nn.Module, out: str | Path, tokenizer=None, metadata: dict | None = None, overwrite: bool = False
) -> Path:
    """Save the merged model (``save_pretrained``) with its tokenizer and ``moectl_merge.json``, atomically."""

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(tmp)
        make_portable(tmp)  # the config keys and tokenizer class other loaders read
        (tmp / METADATA).write_text(json.dumps(metadata or {}, indent=2, default=str) + "\n")

    return write_dir_atomic(Path(out), write, overwrite=overwrite)
