"""How many threads moectl computes with: the CPUs this process may use and that are idle now.

A machine is rarely idle. PyTorch's default (one thread per core it sees) oversubscribes a core
that another process is using, and OpenMP threads that spin while waiting at a barrier then take
turns with that process: a decode step can run several times slower than on one thread. So:

- ``usable_cpus()``: the CPUs the process may run on (``sched_getaffinity``), capped by a cgroup
  CPU quota (``cpu.max`` in cgroup v2, ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` in v1);
- ``idle_cpus()``: how many of those were idle over a short sample of ``/proc/stat``;
- ``pick_threads()``: the idle ones, at least one (a ``--threads`` given by the user wins).

The CLI sets the result with ``torch.set_num_threads`` before a command that runs a model; see
``benchmarks/threads_busy.py`` for the measurement behind it.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from pathlib import Path


def _affinity() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))


def cgroup_quota(root: str | Path = "/sys/fs/cgroup") -> float | None:
    """CPUs' worth of time the process's cgroup may use (None: no quota)."""
    root = Path(root)
    try:
        fields = (root / "cpu.max").read_text().split()
        if fields and fields[0] != "max":
            return int(fields[0]) / int(fields[1])
        return None
    except (OSError, ValueError, IndexError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def usable_cpus() -> int:
    """CPUs this process may use: its affinity, capped by the cgroup quota (rounded up)."""
    n = len(_affinity())
    quota = cgroup_quota()
    return max(1, min(n, math.ceil(quota))) if quota is not None else max(1, n)


def _cpu_times(cpus: list[int]) -> dict[int, tuple[int, int]]:
    """(idle, total) jiffies of each CPU in ``cpus`` from /proc/stat."""
    out: dict[int, tuple[int, int]] = {}
    wanted = set(cpus)
    for line in Path("/proc/stat").read_text().splitlines():
        name, *values = line.split()
        if not name.startswith("cpu") or name == "cpu":
            continue
        cpu = int(name[3:])
        if cpu in wanted:
            ticks = [int(v) for v in values[:8]]
            out[cpu] = (ticks[3] + ticks[4], sum(ticks))  # idle + iowait, all
    return out


def idle_cpus(sample_s: float = 0.25) -> float | None:
    """How many of this process's CPUs were idle over ``sample_s`` seconds (None off Linux)."""
    cpus = _affinity()
    try:
        before = _cpu_times(cpus)
        time.sleep(sample_s)
        after = _cpu_times(cpus)
    except (OSError, ValueError):
        return None
    idle = 0.0
    for cpu, (i1, t1) in after.items():
        i0, t0 = before.get(cpu, (i1, t1))
        if t1 > t0:
            idle += (i1 - i0) / (t1 - t0)
    return idle


def pick_threads(requested: int | None = None, sample_s: float = 0.25) -> int:
    """``requested`` if given, else ``OMP_NUM_THREADS`` if set (the user's choice for the process),
    else the usable CPUs that are idle now (rounded), at least 1."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--threads must be >= 1, got {requested}")
        return requested
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) >= 1:
        return int(env)
    usable = usable_cpus()
    idle = idle_cpus(sample_s)
    if idle is None:
        return usable
    return max(1, min(usable, int(idle + 0.3)))  # a CPU 70% idle counts as free


def _own_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


class ThreadGovernor:
    """Re-picks the thread count of a long-running loop (a server's engine) as the machine's load
    changes: every ``interval_s`` it measures the CPUs other processes kept busy since the last look
    (all CPUs' busy time from /proc/stat minus this process's own CPU time) and uses the rest.

    Call ``update()`` from the thread that runs the model (torch's thread count is per thread under
    OpenMP); it returns the new count when it changed, else None.
    """

    def __init__(self, interval_s: float = 5.0, apply=None, choices: Sequence[int] | None = None) -> None:
        import torch

        self.interval_s = interval_s
        self.choices = sorted(choices) if choices else None  # counts it may pick (the largest that fits)
        self.apply = apply or torch.set_num_threads
        self.cpus = _affinity()
        self.usable = usable_cpus()
        self.current = torch.get_num_threads()
        self._last = self._sample()

    def _sample(self) -> tuple[float, float, float] | None:
        try:
            times = _cpu_times(self.cpus)
        except (OSError, ValueError):
            return None
        busy = sum(total - idle for idle, total in times.values()) / os.sysconf("SC_CLK_TCK")
        return time.monotonic(), busy, _own_cpu_s()

    def others_busy(self, before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
        """CPUs' worth of time other processes used between two samples."""
        wall = after[0] - before[0]
        if wall <= 0:
            return 0.0
        return max(0.0, (after[1] - before[1]) - (after[2] - before[2])) / wall

    def update(self) -> int | None:
        now = time.monotonic()
        if self._last is None or now - self._last[0] < self.interval_s:
            return None
        sample = self._sample()
        if sample is None:
            return None
        others = self.others_busy(self._last, sample)
        self._last = sample
        wanted = max(1, min(self.usable, int(self.usable - others + 0.3)))  # a CPU 70% free counts
        if self.choices:
            wanted = max([c for c in self.choices if c <= wanted] or self.choices[:1])
        if wanted == self.current:
            return None
        self.apply(wanted)
        self.current = wanted
        return wanted
