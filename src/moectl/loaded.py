"""``moectl.load(MODEL)``: a model, its tokenizer and its MoE description in one call (for notebooks).

model, tokenizer, info = moectl.load("tiny:olmoe")      # or a checkpoint folder, or a hub id
loaded = moectl.load("runs/emo-small"); loaded.info.top_k
"""

from __future__ import annotations

from typing import Any, NamedTuple

from torch import nn

from moectl.adapters.inspect import ModelInfo, inspect


class Loaded(NamedTuple):
    """What ``moectl.load`` returns: unpack it or read its fields."""

    model: nn.Module
    tokenizer: Any
    info: ModelInfo


def load(spec: str, *, dtype: str = "auto", device: str = "cpu", seed: int = 0) -> Loaded:
    """Load ``spec`` — ``tiny:FAMILY``, a checkpoint folder or a hub id (``moectl.models.load.load_model``)
    — in eval mode with a left-padding tokenizer, and describe its MoE layers (``moectl.inspect``).
    ``seed`` sets a tiny model's random weights."""
    from moectl.models.load import load_model

    model, tokenizer = load_model(str(spec), dtype=dtype, device=device, seed=seed)
    return Loaded(model, tokenizer, inspect(model))
