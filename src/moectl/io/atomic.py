"""Atomic file writes with the usual permissions.

``tempfile.mkstemp`` creates files readable by their owner only (0600) — fine for a temporary
file, wrong for a result renamed into place: a trace, a results JSON or a fetched evaluation set
must get the mode any other new file gets (0666 less the umask). ``atomic_path`` yields a
temporary path beside the target, and on success gives it that mode and renames it into place;
on any error the temporary file is removed and the target is untouched.

Durable too: the file is ``fsync``-ed before the rename and its folder after it, so a power loss
leaves the old file or the new one, never a complete-looking empty one. ``atomic_dir`` does the
same for a whole folder (a checkpoint, an export): written beside its final name, synced, then
swapped in with one ``renameat2(RENAME_EXCHANGE)`` where the system has it. A locked folder write
(``atomic_dir(lock=True)``: the exports) also holds ``.lock-NAME`` beside it, so that a writer killed
mid-way is told from a live one: :func:`remove_stale_tmps` removes the ``.tmp-*`` folders of dead
ones only.

``crash_point`` is a test hook (``MOECTL_CRASH_AFTER=N``: SIGKILL at the N-th step of an atomic
write; ``MOECTL_CRASH_LOG=FILE``: list the steps) that the crash-consistency tests sweep.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from moectl.errors import OutputExistsError

try:
    import fcntl
except ImportError:  # Windows: no flock, so locked writes run unlocked (see writer_lock)
    fcntl = None  # type: ignore[assignment]

CRASH_AFTER = "MOECTL_CRASH_AFTER"
CRASH_LOG = "MOECTL_CRASH_LOG"
_crash_steps = 0


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


def crash_point(what: str) -> None:
    """One step of an atomic write, for the crash-consistency tests: with ``MOECTL_CRASH_LOG`` set,
    append ``N what`` to that file; with ``MOECTL_CRASH_AFTER=N``, SIGKILL this process at step N
    (no cleanup, no ``finally``: what a power cut or ``kill -9`` leaves). Free when neither is set."""
    global _crash_steps
    after, log = os.environ.get(CRASH_AFTER), os.environ.get(CRASH_LOG)
    if not after and not log:
        return
    _crash_steps += 1
    if log:
        with open(log, "a", encoding="utf-8") as fh:
            fh.write(f"{_crash_steps} {what}\n")
    if after and _crash_steps == int(after):
        os.kill(os.getpid(), signal.SIGKILL)


def fsync_path(path: str | Path) -> None:
    """Flush a file's (or, on POSIX, a folder's entries') data to the disk. A folder that cannot be
    opened or synced (Windows; some network and FUSE file systems: EINVAL, ENOTSUP; no read
    permission) is skipped: the rename is then as durable as that file system makes it."""
    folder = Path(path).is_dir()
    if folder and os.name == "nt":
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except PermissionError:
        if folder:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as err:
        if not (folder and err.errno in (errno.EINVAL, errno.ENOTSUP, errno.EBADF)):
            raise
    finally:
        os.close(fd)


def fsync_tree(folder: str | Path) -> None:
    """``fsync`` every file and folder under ``folder`` (and ``folder``), deepest first."""
    folder = Path(folder)
    for path in sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if not path.is_symlink():
            fsync_path(path)
    fsync_path(folder)


def output_error(path: str | Path, err: OSError) -> OSError:
    """``err`` as one line naming ``path`` (not a temporary name, not ``[Errno 21]``): what is wrong."""
    path = Path(path)
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:  # NotADirectoryError, or FileExistsError from mkdir(parents=True)
        return NotADirectoryError(f"{path} cannot be written: {blocker} is a file, not a folder")
    if isinstance(err, IsADirectoryError):
        why = "is a folder: give a file path"
    elif isinstance(err, PermissionError):
        why = "cannot be written: permission denied"
    else:
        why = f"cannot be written: {err.strerror or err}"
    return type(err)(f"{path} {why}")


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it to ``path`` when the block succeeds (the
    file synced before, its folder after)."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder: give a file path")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:
        raise output_error(path, err) from err
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        crash_point(f"wrote {tmp.name}")
        fsync_path(tmp)
        tmp.chmod(default_mode())
        crash_point(f"synced {tmp.name}")
        os.replace(tmp, path)
        crash_point(f"renamed to {path.name}")
        fsync_path(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically, with the usual mode."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def save_figure(fig, path: str | Path, dpi: int = 100, **savefig: Any) -> Path:
    """``fig.savefig`` to ``path`` atomically (the format from ``path``'s suffix, PNG without one):
    a plot rewritten after every checkpoint is never left half-drawn. ``savefig``: more of
    matplotlib's options (``bbox_inches="tight"``)."""
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=dpi, format=path.suffix.lstrip(".").lower() or "png", **savefig)
    return path


_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        rename = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_cwd = -100
    if rename(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # this file system cannot
        return False
    raise OSError(code, os.strerror(code), str(b))


def recover_dir(final: str | Path) -> Path:
    """Finish a folder swap that a crash cut short where no one-step exchange exists: if ``final`` is
    missing and ``.old-NAME`` beside it holds the previous version, put it back; a ``.old-NAME``
    beside a present ``final`` is stale and removed."""
    final = Path(final)
    old = final.with_name(f".old-{final.name}")
    if old.is_dir():
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, final)
    return final


def _carry_over(old: Path, new: Path) -> None:
    """Hard-link every entry of ``old`` that ``new`` lacks into ``new`` (folders recursively)."""
    for entry in old.iterdir():
        target = new / entry.name
        if target.exists() or target.is_symlink() or entry.name.startswith((".tmp-", ".old-")):
            continue
        if entry.is_symlink():
            os.symlink(os.readlink(entry), target)
        elif entry.is_dir():
            shutil.copytree(entry, target, symlinks=True, copy_function=os.link)
        else:
            os.link(entry, target)


@contextmanager
def atomic_dir(
    final: str | Path, overwrite: bool = True, keep_others: bool = False, lock: bool = False
) -> Iterator[Path]:
    """Yield a fresh ``.tmp-NAME`` folder beside ``final``; when the block succeeds, give its files the
    usual mode, sync them, and put it in place of ``final`` in one step (an existing ``final`` is
    exchanged with it, then removed), so ``final`` is the old folder or the new, never a mix.

    An existing ``final`` is replaced only with ``overwrite`` (else FileExistsError before anything is
    written). ``keep_others``: entries of an existing ``final`` that the block did not write are carried
    into the new folder (hard links: no copy, and the old folder stays as it was). On an error the temporary folder is removed; after a kill it stays, and the next write of
    the same name removes it. ``lock``: hold ``.lock-NAME`` for the whole write (:func:`writer_lock`:
    OutputExistsError while another process writes ``final``), which marks ``.tmp-NAME`` as live
    for :func:`remove_stale_tmps`.
    """
    with writer_lock(final) if lock else nullcontext(), _swap_dir(Path(final), overwrite, keep_others) as tmp:
        yield tmp


@contextmanager
def _swap_dir(final: Path, overwrite: bool, keep_others: bool) -> Iterator[Path]:
    """:func:`atomic_dir` without its lock."""
    recover_dir(final)
    if final.exists() and not overwrite:
        raise FileExistsError(f"{final} already exists (pass overwrite / --overwrite to replace it)")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".tmp-{final.name}")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    except OSError as err:
        raise output_error(final, err) from err
    try:
        yield tmp
        usual_modes(tmp)
        if keep_others and final.is_dir():
            _carry_over(final, tmp)
        crash_point(f"wrote {tmp.name}")
        fsync_tree(tmp)
        crash_point(f"synced {tmp.name}")
        if not final.exists():
            os.replace(tmp, final)
            crash_point(f"renamed to {final.name}")
        elif _exchange(tmp, final):
            crash_point(f"exchanged with {final.name}")
        else:  # two renames: a crash between them leaves .old-NAME, which recover_dir puts back
            old = final.with_name(f".old-{final.name}")
            os.replace(final, old)
            crash_point(f"moved {final.name} aside")
            os.replace(tmp, final)
            crash_point(f"renamed to {final.name}")
            tmp = old
        fsync_path(final.parent)
        crash_point(f"synced {final.parent.name}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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


# -- locked writes: a killed writer's temporary folder told from a live one's ------------------------
_UNLOCKED = -1  # what _try_lock gives where there is no flock (the platform, the file system)


def lock_path(final: str | Path) -> Path:
    """The lock file of a locked atomic write of ``final``: ``.lock-NAME`` beside it."""
    final = Path(final)
    return final.with_name(f".lock-{final.name}")


def _try_lock(path: Path) -> int | None:
    """A descriptor of ``path`` (created if missing) holding its exclusive ``flock``, with this process's
    pid written in it; None while another process holds it; ``_UNLOCKED`` where there is no ``flock``.
    A lock file that its holder unlinked between our open and our lock is opened anew."""
    if fcntl is None:
        return _UNLOCKED
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, default_mode())
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError:  # ENOLCK, EINVAL: a file system without locks, where no lock file is kept
            os.close(fd)
            path.unlink(missing_ok=True)
            return _UNLOCKED
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        mine = os.fstat(fd)
        if current is not None and (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino):
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            return fd
        os.close(fd)


def _unlock(path: Path, fd: int) -> None:
    """Remove the lock file ``path`` and let go of its lock (unlinked first, while still held)."""
    try:
        path.unlink(missing_ok=True)
    finally:
        os.close(fd)


def _holder(path: Path) -> str:
    """The pid a lock file records, as text ('?' when it records none)."""
    try:
        return path.read_text().strip() or "?"
    except OSError:
        return "?"


@contextmanager
def writer_lock(final: str | Path) -> Iterator[None]:
    """Hold ``.lock-NAME`` beside ``final`` (:func:`lock_path`; created, recording this pid, removed
    after) for the block: the mark that ``final``'s ``.tmp-NAME`` has a live writer. OutputExistsError,
    naming the pid and the temporary folder, while another process holds it. Where there is no
    ``flock`` (Windows, some network file systems) the block runs unlocked."""
    final = Path(final)
    lock = lock_path(final)
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = _try_lock(lock)
    except OSError as err:
        raise output_error(final, err) from err
    if fd is None:
        raise OutputExistsError(
            f"{final} is being written by another process (pid {_holder(lock)}, into "
            f"{final.with_name(f'.tmp-{final.name}')}): wait for it to finish, or give another output"
        )
    try:
        yield
    finally:
        if fd != _UNLOCKED:
            _unlock(lock, fd)


def remove_stale_tmps(final: str | Path) -> list[Path]:
    """Remove the temporary folders that killed writers left beside ``final``; return those removed.

    Removed: ``final``'s own ``.tmp-NAME`` unless a live process holds its lock, and every other
    ``.tmp-*`` there with a ``.lock-*`` that no live process holds (a locked write killed mid-way:
    SIGKILL, out of memory, a power cut; a killed writer's ``flock`` is gone with it, whatever pid it
    recorded). A ``.tmp-*`` of another name with no lock file (an unlocked atomic write, or one by an
    older moectl) is left alone: nothing tells whether its writer still runs. Nothing is removed where
    there is no ``flock``."""
    final = Path(final)
    parent = final.parent
    if fcntl is None or not parent.is_dir():
        return []
    removed = []
    for tmp in sorted(parent.glob(".tmp-*")):
        name = tmp.name.removeprefix(".tmp-")
        owned = name == final.name or lock_path(parent / name).is_file()
        if tmp.is_dir() and not tmp.is_symlink() and owned and _remove_if_dead(parent / name):
            removed.append(tmp)
    return removed


def _remove_if_dead(final: Path) -> bool:
    """Remove ``final``'s ``.tmp-NAME`` unless a live process holds its lock; whether it is gone."""
    lock, tmp = lock_path(final), final.with_name(f".tmp-{final.name}")
    try:
        fd = _try_lock(lock)
    except OSError:  # the folder cannot be written: left as it is
        return False
    if fd is None or fd == _UNLOCKED:  # a live writer, or no flock here to tell
        return False
    try:
        shutil.rmtree(tmp, ignore_errors=True)
    finally:
        _unlock(lock, fd)
    return not tmp.exists()
