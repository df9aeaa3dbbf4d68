"""Checkpoint folders that a package above ``models/`` knows how to load (issue 40 item 2).

``moectl.models.load.load_model`` reads a local folder with transformers' ``from_pretrained``,
unless a loader registered here claims it first. A package higher on the import ladder
(docs/architecture.md) that writes folders transformers cannot read registers ``(claims, load)``
once, from ``moectl/__init__.py``, so ``models/`` loads them without importing that package:
``moectl.quant`` registers its quantized checkpoints (``moectl checkpoint quantize``), which every
verb then loads quantized. ``claims(folder)`` must be cheap (a JSON read): it runs for every local
folder loaded. Pure Python: importing this module loads nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

Claims = Callable[[Path], bool]
Load = Callable[..., tuple[Any, Any]]
"""``load(folder, dtype, device, device_map, with_tokenizer) -> (model, tokenizer)``, as
``load_model`` returns them."""

_LOADERS: dict[str, tuple[Claims, Load]] = {}


def register(name: str, claims: Claims, load: Load) -> None:
    """Register (or, under the same ``name``, replace) a folder loader."""
    _LOADERS[name] = (claims, load)


def claimed_by(folder: Path) -> str | None:
    """The name of the first registered loader that claims ``folder`` (None: transformers' to read)."""
    return next((name for name, (claims, _) in _LOADERS.items() if claims(folder)), None)


def loader_for(folder: Path) -> Load | None:
    """The ``load`` of the first registered loader that claims ``folder``, None if none does."""
    name = claimed_by(folder)
    return None if name is None else _LOADERS[name][1]
