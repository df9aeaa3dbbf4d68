"""Checkpoint folders that a package above ``models/`` knows how to load (issue 40 item 2).

``moectl.models.load.load_model`` reads a local folder with transformers' ``from_pretrained``,
unless a loader registered here claims it first. A package higher on the import ladder
(docs/architecture.md) that writes folders transformers cannot read registers ``(claims, load)``
once, from ``moectl/__init__.py``, so ``models/`` loads them without importing that package:
``moectl.quant`` registers its quantized checkpoints (``moectl checkpoint quantize``), which every
verb then loads quantized. ``claims(folder)`` must be cheap (a JSON read): it runs for every local
folder loaded. A loader may also register ``load_lazy`` (the model with its experts unread, and an
expert store that reads them): offloading (``moectl.offload.loading``) serves such a folder from
it, so a miss reads what the folder stores (a quantized checkpoint: int4 bytes). Pure Python:
importing this module loads nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

Claims = Callable[[Path], bool]
Load = Callable[..., tuple[Any, Any]]
"""``load(folder, dtype, device, device_map, with_tokenizer) -> (model, tokenizer)``, as
``load_model`` returns them."""

LoadLazy = Callable[..., tuple[Any, Any, Any]]
"""``load_lazy(folder, dtype, device, method) -> (model, tokenizer, store)``: the experts unread
(meta), ``store`` an expert store (``load(layer, expert)``, ``layers``, ``close()``) reading them."""

_LOADERS: dict[str, tuple[Claims, Load]] = {}
_LAZY: dict[str, LoadLazy] = {}


def register(name: str, claims: Claims, load: Load, load_lazy: LoadLazy | None = None) -> None:
    """Register (or, under the same ``name``, replace) a folder loader."""
    _LOADERS[name] = (claims, load)
    _LAZY.pop(name, None)
    if load_lazy is not None:
        _LAZY[name] = load_lazy


def claimed_by(folder: Path) -> str | None:
    """The name of the first registered loader that claims ``folder`` (None: transformers' to read)."""
    return next((name for name, (claims, _) in _LOADERS.items() if claims(folder)), None)


def loader_for(folder: Path) -> Load | None:
    """The ``load`` of the first registered loader that claims ``folder``, None if none does."""
    name = claimed_by(folder)
    return None if name is None else _LOADERS[name][1]


def lazy_loader_for(folder: Path) -> LoadLazy | None:
    """The ``load_lazy`` of the loader that claims ``folder``, None if none does or it has none."""
    name = claimed_by(folder)
    return None if name is None else _LAZY.get(name)
