"""This process's memory cgroup (v1 or v2), read from ``/proc/self/cgroup``: one reader for the
serving memory plan's limits (``offload/plan.py``) and the page-cache measurement
(``io/page_cache.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CGROUP_V1 = Path("/sys/fs/cgroup/memory")
CGROUP_V2 = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class MemoryCgroup:
    """One memory cgroup of this process: its path below the hierarchy's root, and the version."""

    path: Path  # relative to the root, e.g. memcap-1234
    version: int  # 1: the v1 memory controller; 2: the unified hierarchy

    @property
    def root(self) -> Path:
        return CGROUP_V2 if self.version == 2 else CGROUP_V1

    @property
    def folder(self) -> Path:
        return self.root / self.path

    @property
    def limit_file(self) -> str:
        return "memory.max" if self.version == 2 else "memory.limit_in_bytes"


def memory_cgroups() -> list[MemoryCgroup]:
    """This process's memory cgroups, the v1 memory controller's first (empty if unreadable)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            found.append(MemoryCgroup(Path(path.lstrip("/")), 2))
        elif "memory" in controllers.split(","):
            found.append(MemoryCgroup(Path(path.lstrip("/")), 1))
    return sorted(found, key=lambda group: group.version)


def memory_limits() -> list[int]:
    """Every memory limit on this process's cgroups and their ancestors ("max" or a huge number is
    no limit)."""
    limits = []
    for group in memory_cgroups():
        for folder in [group.path, *group.path.parents]:
            try:
                text = (group.root / folder / group.limit_file).read_text().strip()
            except OSError:
                continue
            if text.isdigit() and int(text) < 2**60:
                limits.append(int(text))
    return limits
