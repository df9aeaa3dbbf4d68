"""Compile a C source shipped with moectl for this machine, once, and load it with ``ctypes``.

The shared object is cached under ``$MOECTL_KERNEL_CACHE`` (else ``$XDG_CACHE_HOME/moectl/kernels``
or ``~/.cache/moectl/kernels``; a temporary folder where none is writable), named by a hash of the
source, the compiler's version and the CPU's flags, so an upgrade or another machine builds its own.
It is compiled to a temporary name and renamed into place: a build killed half-way leaves no file
that a later load would take. Without a C compiler, or when the build fails, :func:`load` returns
None and the callers keep PyTorch's kernels.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")


def cache_dir() -> Path:
    """Where built kernels are kept (see the module docstring)."""
    if os.environ.get("MOECTL_KERNEL_CACHE"):
        return Path(os.environ["MOECTL_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moectl" / "kernels"


def cpu_flags() -> str:
    """This CPU's ``flags`` line of ``/proc/cpuinfo`` ("" where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _writable(folder: Path) -> Path:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder):
            return folder
    except OSError:
        fallback = Path(tempfile.gettempdir()) / f"moectl-kernels-{os.getuid()}"
        fallback.mkdir(parents=True, exist_ok=True)
        return fallback


def build(source: Path, defines: tuple[str, ...] = ()) -> Path | None:
    """The shared object built from ``source`` for this machine (built now if not cached), or None.
    ``defines``: ``-D`` flags of a variant (``"FAR_TILES=0"``; benchmarks compare variants this way)."""
    cc = _compiler()
    if cc is None:
        log.info("no C compiler: %s not built, PyTorch's kernels used", source.name)
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    key = hashlib.sha256(
        source.read_bytes() + version.encode() + cpu_flags().encode() + " ".join(FLAGS + defines).encode()
    ).hexdigest()[:16]
    folder = _writable(cache_dir())
    target = folder / f"{source.stem}-{key}.so"
    if target.is_file():
        return target
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{source.stem}-", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run(
            [cc, *FLAGS, *(f"-D{d}" for d in defines), str(source), "-o", tmp], capture_output=True, text=True,
            timeout=300,
        )
        if done.returncode != 0:
            log.warning(
                "building %s failed, PyTorch's kernels used: %s", source.name, done.stderr.strip()[:500]
            )
            return None
        os.replace(tmp, target)
        return target
    except (OSError, subprocess.SubprocessError) as err:
        log.warning("building %s failed, PyTorch's kernels used: %s", source.name, err)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@cache
def load(name: str) -> ctypes.CDLL | None:
    """The library built from ``moectl/kernels/NAME.c``, or None where it cannot be built."""
    path = build(Path(__file__).with_name(f"{name}.c"))
    if path is None:
        return None
    try:
        return ctypes.CDLL(str(path))
    except OSError as err:
        log.warning("loading %s failed, PyTorch's kernels used: %s", path, err)
        return None
