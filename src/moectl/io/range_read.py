"""Read byte ranges of files into caller-owned buffers, keeping the page cache bounded.

Issue 13/18: serving a model larger than RAM fails when the kernel's page cache — which Linux
charges to a memory cgroup like any other memory — fills the cap with expert bytes that were
already copied into the resident slots. Three methods, chosen per reader (``benchmarks/
shard_read.py`` measures them):

- ``"direct"`` (default): ``O_DIRECT`` reads, which bypass the page cache. The file offset, length
  and buffer must be aligned to the block size, so each contiguous run is read as its aligned
  superset (4096-byte boundaries) into an aligned, reused bounce buffer (an anonymous mapping,
  16 MiB), then copied into the destination. Falls back to ``"fadvise"`` on a file system
  without ``O_DIRECT`` (tmpfs).
- ``"fadvise"``: plain ``preadv`` straight into the destination, then
  ``posix_fadvise(POSIX_FADV_DONTNEED)`` on the range read (page-aligned), so the cache holds at
  most one read at a time; the file is opened with ``POSIX_FADV_RANDOM`` so readahead does not
  pull in (and leave behind) neighbouring bytes.
- ``"plain"``: ``preadv`` and nothing else; the page cache keeps everything read.

Measured (``benchmarks/shard_read.py`` under ``memcap 3G``, full-width OLMoE-1B-7B experts of
12 MiB from a cold cache, 2 busy cores, two runs): direct 1.16-1.21 GB/s with the page cache
unchanged; fadvise 0.92-0.94 GB/s, unchanged; plain 1.12-1.27 GB/s with +1.4 GiB of page cache
(its readahead also pulls in neighbouring experts that later reads find cached). ``"direct"`` is
the default: the best speed of the bounded methods, and it needs no cache at all, so no reclaim
inside a capped cgroup either.

No method maps the file or reads a tensor into an intermediate copy of itself (``"direct"``
copies through a bounce buffer of fixed size). Contiguous ranges are read with one ``preadv``
scattering into several destination buffers; a short read at end of file raises ``ShardError``
(a ``ValueError``) naming the file, its real size and the byte range asked for (a shard truncated
after it was indexed).

A shard changed in place after it was indexed (same size, new bytes) would otherwise be read as
if nothing happened: each file's identity (size, ``st_mtime_ns``, inode; given by the index, or
taken when the file is first opened) is checked with ``fstat`` before and after every read batch,
and a change raises ``ShardError`` naming the shard. One ``os.fstat`` took 2.9 µs here (timeit,
2 busy cores), two per read batch, next to the ~10 ms of a full-width OLMoE expert's 12 MiB read
at the ~1.2 GB/s measured above. A file replaced by rename after it was opened is not a
change: the open descriptor still reads the bytes that were indexed. Limitation: a write within the
file system's timestamp granularity (a few ms) of the indexing leaves the identity unchanged.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from moectl.errors import ConfigError, MoectlError

READ_METHODS = ("direct", "fadvise", "plain")
DEFAULT_READ_METHOD = "direct"
ALIGN = 4096
BOUNCE_BYTES = 16 * 2**20
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


class ShardError(MoectlError, ValueError):
    """A shard no longer holds the bytes it was indexed with (truncated, or changed in place)."""

    def __init__(self, message: str, path: Path, start: int | None = None, size: int | None = None) -> None:
        super().__init__(message)
        self.path, self.start, self.size = path, start, size


FileIdentity = tuple[int, int, int]  # (size, st_mtime_ns, st_ino)


def file_identity(stat: os.stat_result) -> FileIdentity:
    return stat.st_size, stat.st_mtime_ns, stat.st_ino


def _truncated(fd: int, path: Path, start: int, end: int) -> ShardError:
    size = os.fstat(fd).st_size
    return ShardError(
        f"{path}: truncated: the shard has {size} bytes, the read needs bytes {start}..{end}", path, start, size
    )


def align_down(n: int) -> int:
    return n - n % ALIGN


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class ReadStats:
    """What a reader did: payload bytes, bytes read from the file (aligned supersets), calls, time."""

    bytes: int = 0
    file_bytes: int = 0
    calls: int = 0
    seconds: float = 0.0

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


Request = tuple[int, memoryview]  # (absolute file offset, destination buffer of the bytes to read)


def _runs(requests: list[Request]) -> list[tuple[int, list[memoryview]]]:
    """Requests grouped into runs of contiguous file bytes (each run one ``preadv``)."""
    runs: list[tuple[int, list[memoryview]]] = []
    end = -1
    for offset, buffer in sorted(requests, key=lambda r: r[0]):
        if not buffer.nbytes:
            continue
        if runs and offset == end and len(runs[-1][1]) < _IOV_MAX:
            runs[-1][1].append(buffer)
        else:
            runs.append((offset, [buffer]))
        end = offset + buffer.nbytes
    return runs


class RangeReader:
    """Reads ``(offset, buffer)`` requests from files with one of ``READ_METHODS``; thread-safe."""

    def __init__(
        self,
        method: str = DEFAULT_READ_METHOD,
        bounce_bytes: int = BOUNCE_BYTES,
        identities: dict[Path, FileIdentity] | None = None,
    ) -> None:
        """``identities``: each file's (size, mtime_ns, inode) when it was indexed; files not in it
        are pinned when first opened."""
        if method not in READ_METHODS:
            raise ConfigError(f"read method must be one of {', '.join(READ_METHODS)}, got {method!r}")
        if bounce_bytes < ALIGN or bounce_bytes % ALIGN:
            raise ConfigError(f"bounce_bytes must be a positive multiple of {ALIGN}, got {bounce_bytes}")
        self.method, self.bounce_bytes = method, bounce_bytes
        self.stats = ReadStats()
        self._fds: dict[Path, tuple[int, str]] = {}
        self._identity: dict[Path, FileIdentity] = {Path(k): v for k, v in (identities or {}).items()}
        self._lock = threading.Lock()
        self._local = threading.local()

    # -- files ------------------------------------------------------------------------------------
    def _open(self, path: Path) -> tuple[int, str]:
        with self._lock:
            if path in self._fds:
                return self._fds[path]
            method = self.method
            try:
                if method == "direct":
                    try:
                        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                    except OSError as err:
                        if err.errno != errno.EINVAL:  # no O_DIRECT on this file system (tmpfs)
                            raise
                        method = "fadvise"
                if method != "direct":
                    fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError as err:
                raise ShardError(f"{path}: shard is missing", path) from err
            if method == "fadvise":
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            self._identity.setdefault(path, file_identity(os.fstat(fd)))
            self._fds[path] = (fd, method)
            return fd, method

    def _check(self, fd: int, path: Path) -> None:
        """Raise ``ShardError`` if ``path`` is not the file it was when indexed (or first opened)."""
        now = file_identity(os.fstat(fd))
        was = self._identity[path]
        if now == was:
            return
        if now[0] < was[0]:
            raise ShardError(
                f"{path}: truncated after it was indexed: the shard has {now[0]} bytes, it had {was[0]}",
                path,
                size=now[0],
            )
        what = "replaced" if now[2] != was[2] else "modified in place"
        raise ShardError(
            f"{path}: the shard was {what} after it was indexed ({was[0]} -> {now[0]} bytes, modification "
            "time changed): its bytes no longer match the index; load the model again",
            path,
            size=now[0],
        )

    def method_for(self, path: str | Path) -> str:
        """The method actually used for ``path`` (``"direct"`` falls back where unsupported)."""
        return self._open(Path(path))[1]

    def close(self) -> None:
        with self._lock:
            for fd, _ in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading ----------------------------------------------------------------------------------
    def read(self, path: str | Path, requests: list[Request]) -> None:
        """Fill every request's buffer with the file's bytes at its offset."""
        path = Path(path)
        fd, method = self._open(path)
        self._check(fd, path)
        t0 = time.perf_counter()
        payload = file_bytes = calls = 0
        for start, buffers in _runs(requests):
            size = sum(b.nbytes for b in buffers)
            try:
                if method == "direct":
                    file_bytes_run, calls_run = self._read_direct(fd, path, start, size, buffers)
                else:
                    calls_run = _preadv_all(fd, path, start, buffers)
                    file_bytes_run = size
            except OSError as err:  # EIO and the like: name the shard and the bytes
                raise ShardError(
                    f"{path}: cannot read bytes {start}..{start + size}: {err.strerror or err}", path, start
                ) from err
            if method == "fadvise":
                lo = align_down(start)
                os.posix_fadvise(fd, lo, align_up(start + size) - lo, os.POSIX_FADV_DONTNEED)
            payload += size
            file_bytes += file_bytes_run
            calls += calls_run
        seconds = time.perf_counter() - t0
        self._check(fd, path)  # changed while being read: these bytes may mix old and new
        with self._lock:
            self.stats.bytes += payload
            self.stats.file_bytes += file_bytes
            self.stats.calls += calls
            self.stats.seconds += seconds

    def _bounce(self) -> memoryview:
        bounce = getattr(self._local, "bounce", None)
        if bounce is None:
            # page-aligned; MAP_PRIVATE: anonymous memory (a shared mapping would count as page cache)
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
            self._local.mapping = mmap.mmap(-1, self.bounce_bytes, flags=flags)
            bounce = self._local.bounce = memoryview(self._local.mapping)
        return bounce

    def _read_direct(
        self, fd: int, path: Path, start: int, size: int, buffers: list[memoryview]
    ) -> tuple[int, int]:
        """Read [start, start + size) as aligned windows through the bounce buffer; scatter it."""
        bounce = self._bounce()
        end = start + size
        window = align_down(start)
        stop = align_up(end)
        placed = []  # (file offset of each buffer, buffer)
        at = start
        for buffer in buffers:
            placed.append((at, buffer))
            at += buffer.nbytes
        first = 0  # buffers before this one are filled
        file_bytes = calls = 0
        while window < stop:
            length = min(len(bounce), stop - window)
            need = min(end, window + length) - window
            got = 0
            while got < need:  # a read may return less: continue from where it stopped (aligned)
                n = os.preadv(fd, [bounce[got:length]], window + got)
                calls += 1
                got += n
                if n == 0 or got % ALIGN:  # end of file (O_DIRECT reads stop short only there)
                    break
            if got < need:
                raise _truncated(fd, path, start, end)
            file_bytes += length
            lo_window, hi_window = max(start, window), min(end, window + length)
            for i in range(first, len(placed)):
                b_start, buffer = placed[i]
                b_end = b_start + buffer.nbytes
                if b_start >= hi_window:
                    break
                lo, hi = max(lo_window, b_start), min(hi_window, b_end)
                if lo < hi:
                    buffer[lo - b_start : hi - b_start] = bounce[lo - window : hi - window]
                if b_end <= hi_window:
                    first = i + 1
            window += length
        return file_bytes, calls


def _preadv_all(fd: int, path: Path, offset: int, buffers: list[memoryview]) -> int:
    """``preadv`` until every buffer is full (a read may return less); returns the calls made."""
    pending = list(buffers)
    start, end = offset, offset + sum(b.nbytes for b in buffers)
    calls = 0
    while pending:
        got = os.preadv(fd, pending, offset)
        calls += 1
        if got == 0:
            raise _truncated(fd, path, start, end)
        offset += got
        while got and pending:
            if got >= pending[0].nbytes:
                got -= pending[0].nbytes
                pending.pop(0)
            else:
                pending[0] = pending[0][got:]
                got = 0
    return calls
