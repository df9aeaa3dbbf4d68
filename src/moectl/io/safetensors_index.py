"""Where every tensor of a safetensors checkpoint lies on disk, from the shards' headers alone.

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
``data_offsets`` relative to the end of the header) and the tensors' bytes. Reading only the
headers gives, for every tensor of a checkpoint, its file, absolute byte offset, dtype and shape:
enough to read any tensor, or any slice along its first dimension, with ``pread`` and nothing else
(issue 13: serve a model larger than RAM by reading experts straight from the checkpoint's own
shards). Single files (``model.safetensors``) and sharded checkpoints
(``model.safetensors.index.json`` + shards) are both read; a missing, truncated or malformed shard
raises ``ValueError`` naming the file, before anything is read from it.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from moectl.errors import FileFormatError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit

DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint: its file, absolute byte offset and length, dtype and shape."""

    key: str
    file: Path
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        """Bytes of one slice along the first dimension (the whole tensor for a scalar)."""
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes


def _entry(path: Path, data_start: int, key: str, info: object) -> TensorEntry:
    try:
        dtype_name, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]  # type: ignore[index]
        shape = tuple(int(s) for s in shape)
        begin, end = int(begin), int(end)
    except (TypeError, KeyError, ValueError) as err:
        raise FileFormatError(f"{path}: malformed header entry for tensor {key} ({err!r})") from err
    dtype = DTYPES.get(dtype_name)
    if dtype is None:
        raise FileFormatError(f"{path}: tensor {key} has dtype {dtype_name}, which moectl cannot read")
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected or begin < 0:
        raise FileFormatError(
            f"{path}: tensor {key} spans bytes {begin}..{end}, but {dtype_name} {list(shape)} needs {expected}"
        )
    return TensorEntry(key, path, data_start + begin, end - begin, dtype, shape)


def read_header(path: str | Path) -> dict[str, TensorEntry]:
    """Every tensor of one safetensors file, from its header; the file's size is checked against it.

    Raises ``ValueError`` naming the file when it is missing, truncated, longer than its header
    says, or its header is not a safetensors header.
    """
    path = Path(path)
    if not path.is_file():
        raise FileFormatError(f"{path}: shard is missing")
    size = path.stat().st_size
    with open(path, "rb") as shard:
        head = shard.read(8)
        if len(head) < 8:
            raise FileFormatError(f"{path}: truncated ({size} bytes, no safetensors header)")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES:
            raise FileFormatError(f"{path}: not a safetensors file (header length {length})")
        if length > size - 8:
            raise FileFormatError(f"{path}: truncated (header of {length} bytes, file of {size})")
        try:
            header = json.loads(shard.read(length))
        except ValueError as err:
            raise FileFormatError(f"{path}: unreadable safetensors header ({err})") from err
    if not isinstance(header, dict):
        raise FileFormatError(f"{path}: unreadable safetensors header (not a JSON object)")
    data_start = 8 + length
    entries = {
        key: _entry(path, data_start, key, info) for key, info in header.items() if key != "__metadata__"
    }
    expected = max((e.offset + e.nbytes for e in entries.values()), default=data_start)
    if size != expected:
        state = "truncated" if size < expected else "longer than its header says"
        raise FileFormatError(f"{path}: {state} ({size} bytes, its header promises {expected})")
    return entries


class CheckpointIndex:
    """Tensor name -> ``TensorEntry`` over every shard of a checkpoint folder (or one file)."""

    def __init__(self, path: str | Path) -> None:
        root = Path(path).expanduser()
        self.root = root if root.is_dir() else root.parent
        self.entries: dict[str, TensorEntry] = {}
        # (size, mtime_ns, inode) of each shard, taken before its header is read: the range reader
        # checks it before every read, so a shard changed in place since is never read as indexed
        self.identities: dict[Path, tuple[int, int, int]] = {}
        if root.is_file():
            self.files = [root]
            self.entries = self._read_header(root)
            return
        index_path = root / INDEX
        if index_path.is_file():
            try:
                weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as err:
                raise FileFormatError(f"{index_path}: unreadable index ({err!r})") from err
            by_file: dict[str, set[str]] = {}
            for key, name in weight_map.items():
                by_file.setdefault(name, set()).add(key)
            self.files = [root / name for name in sorted(by_file)]
            for name, wanted in sorted(by_file.items()):
                file = root / name
                entries = self._read_header(file)
                missing = sorted(wanted - set(entries))
                if missing:
                    raise FileFormatError(
                        f"{file}: lacks {len(missing)} tensors {INDEX} puts in it, e.g. {missing[0]}"
                    )
                self.entries.update(entries)
        elif (root / SINGLE).is_file():
            self.files = [root / SINGLE]
            self.entries = self._read_header(root / SINGLE)
        else:
            raise FileFormatError(f"{root}: no {INDEX} and no {SINGLE}")

    def _read_header(self, file: Path) -> dict[str, TensorEntry]:
        try:
            st = file.stat()
        except OSError:
            return read_header(file)  # names the missing file
        self.identities[file] = (st.st_size, st.st_mtime_ns, st.st_ino)
        return read_header(file)

    @classmethod
    def from_entries(cls, root: str | Path, entries: dict[str, TensorEntry]) -> CheckpointIndex:
        """An index of given entries (e.g. tensors planned but not written), reading no file."""
        index = cls.__new__(cls)
        index.root, index.entries = Path(root), dict(entries)
        index.identities = {}
        index.files = sorted({e.file for e in entries.values()})
        return index

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def __getitem__(self, key: str) -> TensorEntry:
        return self.entries[key]

    def __len__(self) -> int:
        return len(self.entries)

    def keys(self) -> list[str]:
        return list(self.entries)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data in the checkpoint."""
        return sum(e.nbytes for e in self.entries.values())
