"""A cgroup per sandboxed program: one bound on the memory of all its processes together.

``RLIMIT_AS`` caps each process's address space, so a program that forks N children may hold N
times it (issue #42.4: three children touching 1.4 GB each took 5.1 GB under a 2 GB limit). A
cgroup counts every page its processes use, together, page cache, kernel memory and the files
they write on the sandbox's tmpfs included. Where the evaluator is root and a cgroup hierarchy with
the memory and pids controllers is writable, each program gets its own cgroup:

- cgroup v2 (``/sys/fs/cgroup`` is ``cgroup2``): ``memory.max`` = the bound, ``memory.swap.max`` = 0
  and ``pids.max``, in a cgroup made beside the evaluator's (v2 lets only leaves hold processes, and
  the evaluator's parent delegates memory and pids to its children), or below the root;
- cgroup v1 (hybrid hosts, where memory and pids are v1 hierarchies): a child of the evaluator's
  memory cgroup with ``memory.limit_in_bytes`` = ``memory.memsw.limit_in_bytes`` = the bound (no swap
  beyond it), and a child of its pids cgroup with ``pids.max``.

The evaluator opens the cgroup's ``cgroup.procs`` and hands the descriptor down; the program's process
writes itself there before it drops privileges and closes it, so the program never holds it, and it
and everything it starts are counted. Past the bound the kernel's OOM killer kills inside that cgroup
only. After the run the cgroup's peak usage is read (v2 ``memory.peak``, v1
``memory.max_usage_in_bytes``), anything left in it is killed and it is removed. The program cannot
leave it: as uid 65534 it may not write another cgroup's ``cgroup.procs``, and in namespace mode no
cgroup filesystem is mounted in its root.

Where no cgroup can be made (not root, no writable hierarchy) moectl.eval.sandbox bounds memory with
limits whose product is the bound instead (:func:`fallback_limits`).
"""

from __future__ import annotations

import os
import secrets
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

ROOT = Path("/sys/fs/cgroup")
PREFIX = "moectl-sandbox-"
FALLBACK_PROCESSES = 4  # without a cgroup: at most this many processes, sharing the bound's address space
FALLBACK_MIN_SPACE = 128 * 1024**2  # ... each with at least this much (a thread alone reserves ~70 MiB)
_REMOVE_WAIT_S = 2.0  # for the killed processes to leave the cgroup before it can be removed


@dataclass(frozen=True)
class CgroupPlan:
    """Where the per-program cgroups are made: v2, one folder; v1, the memory and the pids folder."""

    version: Literal[1, 2]
    parents: tuple[Path, ...]

    def describe(self) -> str:
        return f"cgroup v{self.version} ({', '.join(str(p) for p in self.parents)})"


@dataclass
class ProgramCgroup:
    """One program's cgroup(s): ``fds`` are their ``cgroup.procs``, open for writing, for the program to join."""

    plan: CgroupPlan
    folders: tuple[Path, ...]
    fds: list[int] = field(default_factory=list)

    def peak(self) -> int | None:
        """The most memory its processes used at once, in bytes (None: the kernel does not say)."""
        name = "memory.peak" if self.plan.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int((self.folders[0] / name).read_text())
        except (OSError, ValueError):
            return None

    def close_fds(self) -> None:
        for fd in self.fds:
            with suppress(OSError):
                os.close(fd)
        self.fds = []


def fallback_limits(memory_bytes: int, max_processes: int) -> tuple[int, int]:
    """Without a cgroup: (processes, address space of each), whose product is at most ``memory_bytes``.

    ``RLIMIT_NPROC`` and ``RLIMIT_AS``: at most :data:`FALLBACK_PROCESSES` processes (fewer when the
    bound would leave each under :data:`FALLBACK_MIN_SPACE`, one at least), each with an equal share.
    """
    processes = max(1, min(max_processes, FALLBACK_PROCESSES, memory_bytes // FALLBACK_MIN_SPACE))
    return processes, memory_bytes // processes


def _own_cgroups(text: str) -> dict[str, str]:
    """``/proc/self/cgroup`` as {controller: path}; the v2 line (``0::PATH``) under ``""``."""
    own = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                own[controller] = parts[2]
    return own


def _v1_mounts(mountinfo: str) -> dict[str, tuple[str, str]]:
    """{controller: (hierarchy path mounted, mount point)} of the v1 cgroup mounts in ``mountinfo``."""
    mounts = {}
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        after = line.split(" - ", 1)[1].split()
        if len(after) >= 3 and after[0] == "cgroup":
            for option in after[2].split(","):
                mounts.setdefault(option, (fields[3], fields[4]))
    return mounts


def _v2_parent(root: Path, own: dict[str, str]) -> Path | None:
    """The folder to make v2 program cgroups in: the evaluator's parent (its own, at the root)."""
    if "" not in own or not (root / "cgroup.controllers").exists():
        return None
    path = own[""].strip("/")
    parent = root / path if not path else (root / path).parent
    try:
        enabled = set((parent / "cgroup.subtree_control").read_text().split())
    except OSError:
        return None
    return parent if {"memory", "pids"} <= enabled else None


def _v1_parents(own: dict[str, str], mountinfo: str) -> tuple[Path, Path] | None:
    """The evaluator's memory and pids cgroup folders on their v1 mounts."""
    mounts = _v1_mounts(mountinfo)
    folders = []
    for controller in ("memory", "pids"):
        if controller not in own or controller not in mounts:
            return None
        mounted, point = mounts[controller]
        path = own[controller]
        if not (path + "/").startswith(mounted.rstrip("/") + "/"):
            return None  # the evaluator's cgroup is outside the mounted part of the hierarchy
        folders.append(Path(point, path[len(mounted.rstrip("/")) :].lstrip("/")))
    return folders[0], folders[1]


def find_plan(
    root: Path = ROOT,
    own_file: Path = Path("/proc/self/cgroup"),
    mountinfo: Path = Path("/proc/self/mountinfo"),
) -> CgroupPlan | None:
    """Where program cgroups can be made here, checked by making and removing one; None: nowhere."""
    if os.geteuid() != 0:
        return None
    try:
        own = _own_cgroups(own_file.read_text())
        parent = _v2_parent(root, own)
        if parent is not None:
            plan = CgroupPlan(2, (parent,))
        else:
            v1 = _v1_parents(own, mountinfo.read_text())
            if v1 is None:
                return None
            plan = CgroupPlan(1, v1)
        with program_cgroup(plan, 64 * 1024**2, 8):
            pass
    except OSError:
        return None
    return plan


def _write(path: Path, value: str) -> None:
    with open(path, "w") as handle:
        handle.write(value)


def create(plan: CgroupPlan, memory_bytes: int, max_processes: int) -> ProgramCgroup:
    """Make one program's cgroup(s) with the bound set, and open their ``cgroup.procs``."""
    name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    group = ProgramCgroup(plan, tuple(parent / name for parent in plan.parents))
    try:
        for folder in group.folders:
            folder.mkdir()
        memory, pids = group.folders[0], group.folders[-1]
        if plan.version == 2:
            _write(memory / "memory.max", str(memory_bytes))
            if (memory / "memory.swap.max").exists():  # absent without swap accounting
                _write(memory / "memory.swap.max", "0")
        else:
            _write(memory / "memory.limit_in_bytes", str(memory_bytes))
            if (memory / "memory.memsw.limit_in_bytes").exists():  # memory + swap: no swap beyond the bound
                _write(memory / "memory.memsw.limit_in_bytes", str(memory_bytes))
        _write(pids / "pids.max", str(max_processes))
        group.fds = [os.open(folder / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC) for folder in group.folders]
    except OSError:
        remove(group)
        raise
    return group


def remove(group: ProgramCgroup) -> None:
    """Kill what is left in the cgroup(s) and remove them (waiting for the dying to leave)."""
    group.close_fds()
    deadline = time.monotonic() + _REMOVE_WAIT_S
    for folder in reversed(group.folders):
        while folder.exists():
            _kill_members(folder)
            try:
                folder.rmdir()
            except FileNotFoundError:
                break
            except OSError:  # EBUSY: its processes are still exiting
                if time.monotonic() > deadline:
                    break
                time.sleep(0.002)


def _kill_members(folder: Path) -> None:
    if (folder / "cgroup.kill").exists():  # v2, Linux >= 5.14: the whole cgroup at once
        with suppress(OSError):
            _write(folder / "cgroup.kill", "1")
        return
    with suppress(OSError):
        for pid in (folder / "cgroup.procs").read_text().split():
            with suppress(OSError):
                os.kill(int(pid), signal.SIGKILL)


@contextmanager
def program_cgroup(plan: CgroupPlan, memory_bytes: int, max_processes: int) -> Iterator[ProgramCgroup]:
    """One program's cgroup for the block, removed afterwards."""
    group = create(plan, memory_bytes, max_processes)
    try:
        yield group
    finally:
        remove(group)
