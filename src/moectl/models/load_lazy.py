"""Load a checkpoint for expert offloading: everything but the routed experts, which stay on disk.

``load_lazy(folder)`` builds the model on the meta device and reads only the non-expert weights
(``moectl.models.lazy.load_skeleton``); the returned ``ShardReader`` then reads experts on demand
from the checkpoint's own shards (``moectl.offload`` does so into its resident slots). A model
larger than RAM can be served this way: peak memory is the non-expert weights plus the resident
budget, never the checkpoint (issues 13.3 and 18).
"""

from __future__ import annotations

from pathlib import Path

from moectl.errors import MoectlFileError
from moectl.io.range_read import DEFAULT_READ_METHOD
from moectl.models.lazy import load_skeleton
from moectl.models.load import byte_tokenizer, check_model_folder, padding_left
from moectl.models.shapes import MARKER


def is_checkpoint_folder(spec: str | Path) -> bool:
    """True for a local folder holding ``config.json`` and safetensors weights."""
    folder = Path(spec).expanduser()
    return folder.is_dir() and (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def load_tokenizer(folder: Path, vocab_size: int):
    """The checkpoint's tokenizer, padding on the left (moectl shape checkpoints: the byte tokenizer)."""
    if (folder / MARKER).is_file():
        return byte_tokenizer(vocab_size)
    from transformers import AutoTokenizer

    return padding_left(AutoTokenizer.from_pretrained(str(folder)))


def load_lazy(
    spec: str | Path,
    dtype: str = "auto",
    device: str = "cpu",
    method: str = DEFAULT_READ_METHOD,
    with_tokenizer: bool = True,
):
    """(model with experts on meta, tokenizer, shard reader) of checkpoint folder ``spec``.

    Raises ``FileNotFoundError`` for a path that is not a checkpoint folder and ``ValueError``
    naming the file for a missing or truncated shard, before any weight is read.
    """
    folder = Path(spec).expanduser()
    if not folder.exists():
        raise MoectlFileError(f"{spec}: no such checkpoint folder")
    check_model_folder(folder)
    if not any(folder.glob("*.safetensors")):
        raise MoectlFileError(
            f"{folder} holds no *.safetensors weights: lazy loading reads safetensors shards"
        )
    model, reader = load_skeleton(
        folder, dtype=None if dtype == "auto" else dtype, device=device, method=method
    )
    tokenizer = load_tokenizer(folder, model.config.vocab_size) if with_tokenizer else None
    return model, tokenizer, reader
