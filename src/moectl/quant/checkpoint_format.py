"""moectl's quantized checkpoint layout, version 1 (issue 40 item 2: quantize once, serve many times).

``moectl checkpoint quantize MODEL --out DIR`` (``moectl.quant.save_quantized``) writes a folder that
``moectl.load(DIR)`` and every verb read quantized, without quantizing again:

- ``config.json``: the model's config (portable spellings, ``moectl.io.portable_config``) with a
  ``quantization_config`` block ``{"quant_method": "moectl", "format_version": 1, "scheme":
  "int4" | "int8", "group_size": G (int4; null for int8), "scope": "experts" | "all"}``. Any reader of
  ``config.json`` reads it; transformers' ``from_pretrained`` (5.x) does not know quant_method
  "moectl": it warns "Unknown quantization type ... we will skip the quantization" and its load
  report lists the quantized weights UNEXPECTED and the experts MISSING (randomly initialised), so
  load the folder with moectl.
- ``model.safetensors`` (or ``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json``,
  Hugging Face's sharding): every tensor of the model under its ``state_dict`` name, except each
  quantized weight, which is stored under the name of the module that holds it (``P``):

  * fused experts (``P`` e.g. ``model.layers.0.mlp.experts``): ``P.gate_up.*`` and ``P.down.*``;
  * a Linear layer (shared experts; with scope ``all`` attention, dense MLPs, the LM head):
    ``P.qweight.*``, and its bias as ``P.bias`` in the model's dtype;
  * int8 (symmetric, per output row): ``*.codes`` int8 [E, N, K] and ``*.scale`` float32 [E, N],
    ``w = codes * scale``;
  * int4 (asymmetric, per group of G inputs of a row): ``*.codes`` uint8 [E, N', K'/2], two codes
    0..15 a byte, code 2j in the low nibble (``moectl.quant.portable_int4``), and ``*.scale_zero``
    [E, K'/G, N', 2] in the model's dtype, ``w = (code - 8) * scale + zero``; N' is N padded to a
    multiple of 16 and K' is K padded to a multiple of G (padding rows and inputs are dropped).
    A tensor's G is the asked group where it divides K, else the largest allowed one that does
    (``moectl.quant.int4_groups.group_for``); the scale_zero shape gives it (K' / G groups).

  E is 1 for a Linear layer. Routers, gates beside them, norms and embeddings are stored as they are.
- the tokenizer files and ``generation_config.json`` of the source model, copied. A folder without
  tokenizer files (a ``tiny:`` or ``shape:`` model) reads with moectl's byte tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moectl.errors import FileFormatError
from moectl.quant.quant_config import GROUP_SIZES, SCHEMES, SCOPES

QUANT_METHOD = "moectl"
FORMAT_VERSION = 1
EXPERTS_PARTS = ("gate_up", "down")  # QuantizedExperts' two weights
LINEAR_PART = "qweight"  # QuantizedLinear's weight
STORED = {"int8": ("codes", "scale"), "int4": ("codes", "scale_zero")}  # the tensors of one weight
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
"""Files copied from a source checkpoint folder beside the weights (those it has)."""


def quantization_config(scheme: str, group_size: int | None, scope: str) -> dict[str, Any]:
    """The ``quantization_config`` block a quantized checkpoint's ``config.json`` holds."""
    return {
        "quant_method": QUANT_METHOD,
        "format_version": FORMAT_VERSION,
        "scheme": scheme,
        "group_size": group_size if scheme == "int4" else None,
        "scope": scope,
    }


def read_block(config: dict[str, Any], where: str) -> dict[str, Any] | None:
    """``config``'s moectl ``quantization_config`` block, checked (``FileFormatError`` naming ``where``
    and the bad field); None when the config has none or another loader's (``quant_method``)."""
    block = config.get("quantization_config")
    if not isinstance(block, dict) or block.get("quant_method") != QUANT_METHOD:
        return None
    version = block.get("format_version")
    if version != FORMAT_VERSION:
        raise FileFormatError(
            f"{where}: moectl quantized checkpoint format_version {version!r}; this moectl reads "
            f"version {FORMAT_VERSION} (a newer moectl wrote it? upgrade moectl)"
        )
    checks = (
        ("scheme", SCHEMES, block.get("scheme")),
        ("scope", SCOPES, block.get("scope")),
        ("group_size", GROUP_SIZES if block.get("scheme") == "int4" else (None,), block.get("group_size")),
    )
    for field, allowed, value in checks:
        if value not in allowed:
            raise FileFormatError(
                f"{where}: quantization_config.{field} is {value!r}, expected one of "
                f"{', '.join(str(a) for a in allowed)}"
            )
    return block


def checkpoint_block(folder: str | Path) -> dict[str, Any] | None:
    """The moectl ``quantization_config`` of checkpoint folder ``folder`` (None: not a moectl
    quantized checkpoint, or no readable ``config.json``). Reads the JSON only: cheap, no torch."""
    path = Path(folder).expanduser() / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return read_block(config, str(path)) if isinstance(config, dict) else None


def is_quantized_checkpoint(folder: str | Path) -> bool:
    """Whether ``folder`` is a moectl quantized checkpoint (its config.json says so)."""
    return Path(folder).expanduser().is_dir() and checkpoint_block(folder) is not None


def _load(folder: Path, dtype: str, device: str, device_map: str | None, with_tokenizer: bool) -> tuple:
    from moectl.quant.load_quantized import load_quantized

    return load_quantized(folder, dtype, device, device_map, with_tokenizer)


def _load_lazy(folder: Path, dtype: str, device: str, method: str) -> tuple:
    from moectl.quant.load_quantized import load_quantized_lazy

    return load_quantized_lazy(folder, dtype, device, method)


def install() -> None:
    """Let ``moectl.models.load.load_model`` (and so ``moectl.load`` and every verb) load quantized
    checkpoints (``moectl.models.folder_loaders``); called once by ``moectl/__init__.py``."""
    from moectl.models.folder_loaders import register

    register("quantized checkpoint (moectl checkpoint quantize)", is_quantized_checkpoint, _load, _load_lazy)
