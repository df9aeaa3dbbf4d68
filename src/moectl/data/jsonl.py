"""JSON Lines rows: one JSON object a line, ``.jsonl`` or ``.jsonl.gz`` (UTF-8), blank lines skipped.

Errors are ``ValueError`` naming the file and line: ``data.jsonl:3: not valid JSON (...)``,
``data.jsonl:3: expected a JSON object, got list``, ``data.jsonl:3: each line needs a string "text"
field``. Callers add their own checks with the same ``PATH:LINE`` prefix (see :func:`iter_jsonl_rows`).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator, Sequence
from contextlib import closing
from itertools import islice
from pathlib import Path
from typing import Any, TextIO

from moectl.errors import FileFormatError, MoectlFileError

__all__ = ["iter_jsonl_rows", "open_text", "read_jsonl_rows"]


def open_text(path: str | Path) -> TextIO:
    """Open a text file for reading as UTF-8, through gzip when its name ends in ``.gz``."""
    path = Path(path)
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8")


def iter_jsonl_rows(
    path: str | Path, required_field: str | Sequence[str] | None = None, allow_empty: bool = True
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line number, row)`` for every non-blank line of a JSONL(.gz) file, lazily.

    Every row must be a JSON object. ``required_field`` is a field name, or several alternatives
    of which the first present one counts (``("prompt", "text")``); that field must hold a string
    (non-empty unless ``allow_empty``).
    """
    fields = (required_field,) if isinstance(required_field, str) else tuple(required_field or ())
    try:
        handle = open_text(path)
    except OSError as err:  # a folder, no permission, gone
        raise MoectlFileError(f"{path} cannot be read: {err.strerror or err}") from None
    with handle:
        yield from _rows(path, handle, fields, allow_empty)


def _rows(
    path: str | Path, handle: TextIO, fields: tuple[str, ...], allow_empty: bool
) -> Iterator[tuple[int, dict[str, Any]]]:
    number = 0
    try:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise FileFormatError(
                    f"{path}:{number}: not valid JSON ({err.msg} at column {err.colno})"
                ) from None
            if not isinstance(row, dict):
                raise FileFormatError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
            if fields:
                value = next((row[name] for name in fields if name in row), None)
                if not isinstance(value, str) or not (allow_empty or value):
                    what = "string" if allow_empty else "non-empty string"
                    names = " or ".join(f'"{name}"' for name in fields)
                    raise FileFormatError(f"{path}:{number}: each line needs a {what} {names} field")
            yield number, row
    except (UnicodeDecodeError, EOFError, gzip.BadGzipFile) as err:  # not text, or a cut-off .gz
        raise FileFormatError(f"{path}:{number + 1}: not UTF-8 JSON lines ({err})") from None


def read_jsonl_rows(
    path: str | Path,
    required_field: str | Sequence[str] | None = None,
    limit: int | None = None,
    allow_empty: bool = True,
) -> list[dict[str, Any]]:
    """The rows of a JSONL(.gz) file (at most ``limit``), checked as :func:`iter_jsonl_rows` does."""
    with closing(iter_jsonl_rows(path, required_field, allow_empty)) as rows:
        return [row for _, row in islice(rows, limit)]
