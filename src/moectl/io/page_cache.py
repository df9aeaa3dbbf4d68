"""How much page cache a process's reads leave behind: measurement helpers (benchmarks, tests).

- ``page_cache_bytes()``: the page cache charged to this process's memory cgroup when it runs in
  one of its own (``../shared/tools/memcap`` makes ``memcap-PID`` groups: cgroup v1 ``cache``,
  v2 ``file`` in ``memory.stat``), else the machine's ``Cached`` from ``/proc/meminfo`` (which
  other processes move too).
- ``file_cached_bytes(path)``: bytes of one file resident in the page cache (``mincore`` over a
  mapping of the file that is never touched, so measuring reads nothing) — exact, whatever else
  runs on the machine.
- ``evict(path)``: drop a file's clean pages from the cache (``POSIX_FADV_DONTNEED``), to start
  a measurement cold without root.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

from moectl.io.cgroup import memory_cgroups


def memory_cgroup() -> Path | None:
    """The ``memory.stat`` of this process's memory cgroup (v1 or v2), if it can be read."""
    for group in memory_cgroups():
        stat = group.folder / "memory.stat"
        return stat if stat.is_file() else None
    return None


def page_cache_bytes(source: str = "auto") -> tuple[int, str]:
    """(bytes of page cache, where from): ``"cgroup"``, ``"meminfo"`` or ``"auto"`` (the cgroup
    when it is a ``memcap`` group, the machine otherwise)."""
    stat = memory_cgroup()
    if source == "cgroup" or (
        source == "auto" and stat is not None and stat.parent.name.startswith("memcap-")
    ):
        if stat is None:
            raise OSError("no readable memory cgroup for this process")
        values = dict(line.split() for line in stat.read_text().splitlines())
        key = "cache" if "cache" in values else "file"
        return int(values[key]), f"cgroup {stat.parent} ({key})"
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Cached:"):
            return int(line.split()[1]) * 1024, "/proc/meminfo Cached (whole machine)"
    raise OSError("/proc/meminfo has no Cached line")


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def file_cached_bytes(path: str | Path) -> int:
    """Bytes of ``path`` now in the page cache (whole pages; the file's pages are not touched)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    page = mmap.PAGESIZE
    pages = -(-size // page)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path} for mincore failed")
        try:
            vector = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vector) != 0:
                raise OSError(ctypes.get_errno(), f"mincore on {path} failed")
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
    resident = pages - bytes(vector).count(0)
    return min(resident * page, size)


def evict(path: str | Path) -> None:
    """Drop ``path``'s clean pages from the page cache (dirty ones are written first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
