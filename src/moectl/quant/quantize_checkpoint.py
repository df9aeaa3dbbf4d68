"""``moectl checkpoint quantize MODEL --out DIR``: quantize once, write the checkpoint (issue 40 item 2).

Issue 40 item 2: serving should not re-quantize at every start. :func:`quantize_checkpoint` loads
MODEL (any spec ``moectl.models.load.load_model`` takes), quantizes it (``quantize_model``) and
writes it (``save_quantized``: the layout of ``checkpoint_format``, atomically). ``moectl.load(DIR)``
and every verb then load DIR quantized, packing the stored int4 codes for the kernel instead of
quantizing (``load_quantized``). Every setting is checked before the model loads.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from moectl.errors import ConfigError
from moectl.quant.checkpoint_format import checkpoint_block
from moectl.quant.quant_config import DEFAULT_GROUP_SIZE, check_group_size, check_scheme, check_scope
from moectl.quant.save_quantized import DEFAULT_MAX_SHARD_BYTES, check_out

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def weights_on_disk(spec: str) -> int | None:
    """Bytes of the weight files of checkpoint folder ``spec`` (None: not a local folder)."""
    folder = Path(spec).expanduser()
    if not folder.is_dir():
        return None
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def check_request(
    spec: str, out: str | Path, scheme: str, group_size: int, scope: str, overwrite: bool
) -> Path:
    """Refuse, before any work, what :func:`quantize_checkpoint` cannot do (``ConfigError``,
    ``OutputExistsError``, ``FileFormatError``, each one line); returns ``out`` as a Path."""
    if check_scheme(scheme) is None:
        raise ConfigError("checkpoint quantize needs a scheme: int8 or int4")
    if scheme == "int4":
        check_group_size(group_size)
    check_scope(scope)
    out = check_out(out, overwrite)
    source = Path(spec).expanduser()
    if source.is_dir() and out.resolve() == source.resolve():
        raise ConfigError(f"--out {out} is MODEL itself: write the quantized checkpoint to another folder")
    block = checkpoint_block(source) if source.is_dir() else None
    if block is not None:
        raise ConfigError(
            f"{spec} is a quantized checkpoint already ({block['scheme']}): give the unquantized model"
        )
    return out


def quantize_checkpoint(
    spec: str,
    out: str | Path,
    scheme: str,
    *,
    group_size: int = DEFAULT_GROUP_SIZE,
    scope: str = "experts",
    dtype: str = "auto",
    seed: int = 0,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> dict[str, Any]:
    """Quantize ``spec`` to ``scheme`` (``int8`` | ``int4``; int4 in groups of ``group_size``; ``scope``
    ``experts`` | ``all``) and write it to folder ``out``; returns the summary (``bytes_before``: the
    source's weight files, or for a ``tiny:`` / ``shape:`` / hub model its bytes in memory;
    ``bytes_after``: the folder written; ``quantize`` the ``QuantSummary``; ``seconds``)."""
    from moectl.models.load import load_model
    from moectl.quant.quantize_model import quantize_model
    from moectl.quant.save_quantized import save_quantized

    out = check_request(spec, out, scheme, group_size, scope, overwrite)
    started = time.perf_counter()
    model, tokenizer = load_model(spec, dtype=dtype, device="cpu", seed=seed)
    loaded = time.perf_counter()
    summary = quantize_model(model, scheme, group_size=group_size, scope=scope)
    quantized = time.perf_counter()
    saved = save_quantized(
        model, out, group_size=summary.group_size, scope=scope, source=spec, tokenizer=tokenizer,
        overwrite=overwrite, max_shard_bytes=max_shard_bytes,
    )  # fmt: skip
    written = time.perf_counter()
    on_disk = weights_on_disk(spec)
    return {
        "model": spec,
        **saved,
        "bytes_before": on_disk if on_disk is not None else summary.model_bytes_before,
        "bytes_before_source": "weight files" if on_disk is not None else "model in memory",
        "bytes_after": saved["bytes"],
        "quantize": summary.to_dict(),
        "seconds": {
            "load": round(loaded - started, 3),
            "quantize": round(quantized - loaded, 3),
            "write": round(written - quantized, 3),
            "total": round(written - started, 3),
        },
    }
