"""What ``subset finetune`` and ``subset merge`` read beside a subset checkpoint: the metadata
``subset export`` writes, and a tokenizer (the checkpoint's own, or the byte tokenizer of a tiny
model's export)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moectl.errors import FileFormatError, MoectlFileError, OutputExistsError
from moectl.subsets.export import METADATA

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse an existing ``out`` unless ``overwrite``."""
    if out.exists() and not overwrite:
        raise OutputExistsError(f"{out} already exists; pass --overwrite to replace it")


def subset_metadata(path: Path) -> dict:
    """The ``moectl_subset.json`` that ``moectl subset export`` writes beside a subset's weights, or {}
    (read by ``read_policy_json``, the reader of every subset file: errors name the file)."""
    from moectl.routing.policy_files import read_policy_json

    file = path / METADATA
    if not file.exists():
        return {}
    data = read_policy_json(file, "subset metadata file")
    if not isinstance(data, dict):
        raise FileFormatError(
            f"subset metadata file {file}: expected a JSON object, as `moectl subset export` writes"
        )
    return data


def has_tokenizer(path: Path) -> bool:
    """Whether a checkpoint directory holds tokenizer files (transformers 5 otherwise builds an empty one)."""
    return any((path / name).exists() for name in _TOKENIZER_FILES)


def load_tokenizer(spec: str, tokenizer: str | None, metadata: dict) -> tuple[Any, str | None]:
    """(tokenizer, note): ``tokenizer`` (a path, hub id or ``bytes``), else the checkpoint's own, else
    the byte tokenizer of an exported tiny model (the note says so)."""
    from moectl.models.load import ByteTokenizer

    if tokenizer == "bytes" or (tokenizer is None and spec.startswith("tiny:")):
        return ByteTokenizer(), None
    if tokenizer is None and Path(spec).is_dir() and not has_tokenizer(Path(spec)):
        if str(metadata.get("model", "")).startswith("tiny:"):
            return ByteTokenizer(), f"{spec} is an export of {metadata['model']}: using its byte tokenizer"
        raise MoectlFileError(f"{spec} has no tokenizer files; pass --tokenizer PATH (or 'bytes' for tiny models)")
    from transformers import AutoTokenizer

    try:
        loaded = AutoTokenizer.from_pretrained(tokenizer or spec)
    except (OSError, ValueError) as err:
        raise MoectlFileError(f"no tokenizer loads from {tokenizer or spec} ({err}); pass --tokenizer PATH") from None
    if getattr(loaded, "pad_token_id", None) is None:
        loaded.pad_token = loaded.eos_token
    return loaded, None
