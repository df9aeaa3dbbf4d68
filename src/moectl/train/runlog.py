"""A run's JSONL log (``log.jsonl``): read tolerating a torn last line, rewritten atomically.

Records are appended one line at a time while a run trains, so a kill or power loss can leave the
last line half-written. Reading drops such a line with a warning (the checkpoint a run resumes from
is older than it anyway); a bad line anywhere else is damage, reported naming the file and line.
Rewrites (dropping the records written after a checkpoint) go through ``write_text_atomic``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from moectl.errors import FileFormatError
from moectl.io.atomic import write_text_atomic


def read_log(path: str | Path) -> list[dict[str, Any]]:
    """The records of ``path`` (none if it does not exist); a torn last line is dropped, with a warning."""
    path = Path(path)
    if not path.exists():
        return []
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    records = []
    for i, (n, line) in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if i == len(lines) - 1:
                warnings.warn(f"{path}: dropped its last line {n}, cut short by a crash", stacklevel=2)
                break
            raise FileFormatError(f"{path} line {n} is not a JSON record ({err.msg}): the log is damaged") from err
    return records


def write_log(path: str | Path, records: list[dict[str, Any]]) -> Path:
    """Replace ``path`` with ``records``, one JSON line each, atomically."""
    return write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in records))
