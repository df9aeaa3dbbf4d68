"""Atomic file writes with the usual permissions.

``tempfile.mkstemp`` creates files readable by their owner only (0600) — fine for a temporary
file, wrong for a result renamed into place: a trace, a results JSON or a fetched evaluation set
must get the mode any other new file gets (0666 less the umask). ``atomic_path`` yields a
temporary path beside the target, and on success gives it that mode and renames it into place;
on any error the temporary file is removed and the target is untouched.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def default_mode(directory: bool = False) -> int:
    """The mode a new file (0666) or folder (0777) gets under the current umask."""
    return (0o777 if directory else 0o666) & ~_umask()


_PROC_STATUS = Path("/proc/self/status")
_proc_umask = True  # /proc/self/status has a Umask line (Linux >= 4.7); checked once


def _umask() -> int:
    """The process umask, read without changing it (``os.umask`` can only set it: setting it to 0
    for a moment races with other threads creating files) from /proc/self/status, read on every
    call (the umask may change; the read costs microseconds). Elsewhere: set and restored."""
    global _proc_umask
    if _proc_umask:
        try:
            for line in _PROC_STATUS.read_text().splitlines():
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
        except (OSError, ValueError, IndexError):
            pass
        _proc_umask = False
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it to ``path`` when the block succeeds."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder: give a file path")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        tmp.chmod(default_mode())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically, with the usual mode."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def usual_modes(folder: str | Path) -> Path:
    """Give every file under ``folder`` the usual mode: ``save_pretrained`` in transformers 5.24 and
    safetensors' ``save_file`` write through ``mkstemp`` (0600), which a saved model must not keep."""
    folder = Path(folder)
    mode = default_mode()
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)
    return folder
