"""Start one program in moectl's code-execution sandbox and collect what it reports.

Containment (``namespace`` mode, used when ``unshare`` works: as root, or through a user namespace
for other users): the program runs under ``unshare --pid --fork --kill-child --net --mount --ipc
--uts`` (``--user --map-root-user`` added when not root), so

- it has no network (a new network namespace with only a down loopback): connecting to the
  evaluator's ports fails and ports it binds are not the host's;
- it sees a new root holding read-only system and Python directories and one size-capped tmpfs
  (``/sandbox``, its cwd, also ``/tmp``): the evaluator's files are not there to read or write, and
  filling the disk stops at the tmpfs' size;
- its PID namespace ends with the run: every process it started dies, ``setsid`` or not, and the
  evaluator's processes are not visible to signal;
- as root it runs as uid 65534 (nobody) with ``RLIMIT_NPROC`` (root ignores that limit): fork bombs
  stop at ``max_processes``; for other users it is root of the user namespace stripped of every
  capability (``RLIMIT_NPROC`` counts against the user's own uid), and the bootstrap is
  non-dumpable, so its memory cannot be read through ``/proc`` or ``ptrace``.

Checked with moectl.eval.sandbox_check's hostile programs (all contained): as root and as uid 1000
before issue #42; since, as root in namespace and basic mode, with and without the cgroup, and
through ``unshare --user --map-root-user`` (the non-root prefix, run by root).

Memory is bounded per program, not per process: where the evaluator is root and a cgroup hierarchy
is writable, every program gets its own cgroup (moectl.eval.sandbox_cgroup: ``memory.max`` =
``memory_bytes`` for all its processes together, no swap, ``pids.max`` = ``max_processes``);
elsewhere it may have at most ``FALLBACK_PROCESSES`` processes, each with an equal share of
``memory_bytes`` as address space, so the product is the same bound (sandbox_cgroup.fallback_limits).

The verdict is the harness's (moectl.eval.sandbox_bootstrap): the checks run in the bootstrap
process, which the program cannot read or signal, against the program's functions called over a
pipe with plain values only; the program cannot forge a pass (issue #42.5).

Where ``unshare`` is missing or refused (containers without ``CAP_SYS_ADMIN``, user namespaces
disabled), ``basic`` mode runs the same bootstrap without namespaces: limits, uid 65534 when root
and the Python installation is readable by it, the ``socket`` module disabled (not isolation), and a
subreaper that kills all descendants. A warning names what is missing. ``$MOECTL_SANDBOX`` =
``auto`` (default), ``namespace`` (fail if unavailable) or ``basic`` chooses.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from moectl.errors import ConfigError, MoectlError
from moectl.eval import sandbox_cgroup
from moectl.eval.sandbox_cgroup import FALLBACK_PROCESSES, CgroupPlan, fallback_limits

MODE_VAR = "MOECTL_SANDBOX"
MODES = ("auto", "namespace", "basic")
NOBODY = 65534
BOOTSTRAP = Path(__file__).with_name("sandbox_bootstrap.py")
UNSHARE_FLAGS = ("--pid", "--fork", "--kill-child", "--net", "--mount", "--ipc", "--uts")
_STDERR_TAIL = 1000  # characters of stderr kept
_GRACE_S = 5.0  # beyond the program's timeout, for the bootstrap to report before it is killed
Status = Literal["passed", "failed", "timeout", "error"]


class SandboxUnavailableError(MoectlError, OSError):
    """``$MOECTL_SANDBOX=namespace`` was asked for and namespaces cannot be used here."""


@dataclass(frozen=True)
class Containment:
    """How programs are contained: ``mode``, the command prefix, the uid they run as (None: ours)."""

    mode: Literal["namespace", "basic"]
    prefix: tuple[str, ...]
    uid: int | None
    missing: str = ""  # what ``basic`` mode lacks, for the warning
    cgroup: CgroupPlan | None = None  # where program cgroups are made; None: the rlimit bound

    def memory_bound(self) -> str:
        """How a program's total memory is bounded here, in words."""
        if self.cgroup is not None:
            return f"per-program {self.cgroup.describe()}"
        return f"rlimits: at most {FALLBACK_PROCESSES} processes, each with an equal share of the bound as address space"


@dataclass(frozen=True)
class Checks:
    """What the harness checks against the program, outside its process (empty ``tests``: that it ran).

    ``tests``: trusted code (a problem's asserts); ``context``: trusted code run before them (HumanEval's
    prompt, whose helper functions the tests use); ``names``: the names the tests take from the
    program (called in its process); ``imports``: standard modules the tests use without importing.
    """

    tests: str = ""
    context: str = ""
    names: tuple[str, ...] = ()
    imports: tuple[str, ...] = ()


@dataclass(frozen=True)
class Outcome:
    """The harness's ``verdict`` (None: the sandbox did not report) and ``detail``; the program's stderr;
    ``memory_peak``: the most memory the program's processes used at once (bytes; cgroups only)."""

    verdict: Status | None
    detail: str
    stderr: str
    memory_peak: int | None = None


class SandboxWarning(UserWarning):
    """The sandbox runs without some containment on this machine."""


def _bind_paths() -> list[str]:
    """System and Python directories the program may read (its interpreter and standard library)."""
    paths = ["/usr", "/etc/ld.so.cache", "/etc/localtime"]
    paths += [p for p in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32") if not os.path.islink(p)]
    for path in (sys.base_prefix, sys.prefix, str(Path(sys.executable).resolve().parent.parent)):
        path = os.path.realpath(path)
        if not any(path == p or path.startswith(p.rstrip("/") + "/") for p in paths):
            paths.append(path)
    return paths


def _readable_by_others(path: str) -> bool:
    """Whether uid 65534 could reach ``path``: every folder on the way is world-searchable."""
    parts = Path(os.path.realpath(path)).parts
    return all(os.stat(Path(*parts[: i + 1])).st_mode & 0o001 for i in range(len(parts)))


def _processes_of(uid: int) -> int:
    """How many processes ``uid`` has now (``RLIMIT_NPROC`` counts them all)."""
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with suppress(OSError):
                count += os.stat(f"/proc/{entry}").st_uid == uid
    return count


def namespace_mode() -> Containment:
    """Namespaces through ``unshare`` (a user namespace too when not root); not probed."""
    root = os.geteuid() == 0
    prefix = ("unshare", *(() if root else ("--user", "--map-root-user")), *UNSHARE_FLAGS)
    return Containment("namespace", prefix, NOBODY if root else None, cgroup=cgroup_plan())


def basic_mode(missing: str) -> Containment:
    """No namespaces; ``missing`` says why, for the warning."""
    root = os.geteuid() == 0
    drop = root and all(_readable_by_others(p) for p in (sys.base_prefix, sys.prefix, sys.executable))
    if root and not drop:
        missing += "; the Python installation is not readable by uid 65534, so programs run as root (no process limit)"
    return Containment("basic", (), NOBODY if drop else None, missing, cgroup_plan())


@functools.cache
def cgroup_plan() -> CgroupPlan | None:
    """Where per-program cgroups can be made here (probed once); None: memory is bounded by rlimits."""
    return sandbox_cgroup.find_plan()


@functools.cache
def containment() -> Containment:
    """The strongest containment that works here (probed once: a namespace run of ``pass``)."""
    wanted = os.environ.get(MODE_VAR, "auto") or "auto"
    if wanted not in MODES:
        raise ConfigError(f"${MODE_VAR}={wanted!r}: allowed values are {', '.join(MODES)}")
    if wanted == "basic":
        return basic_mode("namespaces not used ($MOECTL_SANDBOX=basic)")
    if shutil.which("unshare") is None:
        why = "`unshare` (util-linux) is not installed"
    else:
        probe = launch("pass\n", 10.0, 256 * 1024**2, 1024**2, 8, namespace_mode())
        if probe.verdict == "passed":
            return namespace_mode()
        said = (probe.stderr.strip() or probe.detail.strip() or str(probe)).splitlines()[-1]
        why = f"`unshare` failed: {said}"
    if wanted == "namespace":
        raise SandboxUnavailableError(f"${MODE_VAR}=namespace but {why}")
    chosen = basic_mode(
        f"{why}: programs keep the evaluator's network and filesystem view (sockets are only disabled "
        "in Python's socket module)"
    )
    warnings.warn(f"moectl's code sandbox runs in basic mode: {chosen.missing}", SandboxWarning, stacklevel=2)
    return chosen


def launch(
    program: str,
    timeout: float,
    memory_bytes: int,
    file_bytes: int,
    max_processes: int,
    how: Containment | None = None,
    checks: Checks | None = None,
) -> Outcome:
    """Run ``program`` through the bootstrap under ``how`` (default: :func:`containment`) and judge it
    with ``checks`` (default: none, so it passes when it runs to its end)."""
    how = how or containment()
    try:
        group = sandbox_cgroup.create(how.cgroup, memory_bytes, max_processes) if how.cgroup else None
    except OSError as exc:
        return Outcome(None, f"could not make the program's cgroup: {exc}", "")
    try:
        outcome = _run(
            program, timeout, memory_bytes, file_bytes, max_processes, how, checks or Checks(), group
        )
        peak = group.peak() if group is not None else None
    finally:
        if group is not None:
            sandbox_cgroup.remove(group)
    return Outcome(outcome.verdict, outcome.detail, outcome.stderr, peak)


def _limits(how: Containment, memory_bytes: int, timeout: float, file_bytes: int, max_processes: int) -> dict:
    """The program's rlimits: with a cgroup, the bound per process too (a MemoryError rather than the OOM
    killer for one big allocation); without, processes x address space = the bound."""
    runs_as = how.uid if how.uid is not None else os.getuid()
    if how.cgroup is not None:
        processes, space = max_processes, memory_bytes
    else:
        processes, space = fallback_limits(memory_bytes, max_processes)
    return {
        "memory_bytes": space,
        "cpu_seconds": int(timeout) + 2,
        "file_bytes": file_bytes,
        "processes": _processes_of(runs_as) + processes,
    }


def _run(
    program: str,
    timeout: float,
    memory_bytes: int,
    file_bytes: int,
    max_processes: int,
    how: Containment,
    checks: Checks,
    group: sandbox_cgroup.ProgramCgroup | None,
) -> Outcome:
    cgroup_fds = tuple(group.fds) if group is not None else ()
    with tempfile.TemporaryDirectory(prefix="moectl-exec-", ignore_cleanup_errors=True) as tmp:
        work, new_root = Path(tmp, "work"), Path(tmp, "root")
        work.mkdir()
        new_root.mkdir()
        (work / "program.py").write_text(program, encoding="utf-8")
        if how.uid is not None and how.mode == "basic":  # its cwd must be writable by it
            os.chown(work, how.uid, how.uid)
            os.chown(work / "program.py", how.uid, how.uid)
            os.chmod(tmp, 0o711)
        status_fd = os.open(Path(tmp, "status"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        config = {
            "mode": how.mode,
            "root": str(new_root),
            "binds": _bind_paths(),
            "uid": how.uid,
            "gid": how.uid,
            "status_fd": status_fd,
            "cgroup_fds": list(cgroup_fds),
            "timeout": timeout,
            "disk_bytes": max(4 * file_bytes, 1024**2),
            "block_sockets": how.mode == "basic",
            "limits": _limits(how, memory_bytes, timeout, file_bytes, max_processes),
        }
        command = [
            *how.prefix,
            sys.executable,
            "-I",
            "-c",
            BOOTSTRAP.read_text(encoding="utf-8"),
            json.dumps(config),
        ]
        payload = json.dumps(
            {
                "tests": checks.tests,
                "context": checks.context,
                "names": checks.names,
                "imports": checks.imports,
            }
        ).encode()
        try:
            with open(Path(tmp, "stderr"), "wb") as err:
                try:
                    proc = subprocess.Popen(
                        command,
                        cwd=work,
                        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                        stdin=subprocess.PIPE,
                        stdout=subprocess.DEVNULL,
                        stderr=err,
                        pass_fds=(status_fd, *cgroup_fds),
                        start_new_session=True,
                        close_fds=True,
                    )
                except OSError as exc:
                    return Outcome(None, f"could not start the sandbox: {exc}", "")
                finally:
                    if group is not None:
                        group.close_fds()  # the program's process holds them now; the evaluator need not
                _finish(proc, payload, timeout + _GRACE_S)
        finally:
            os.close(status_fd)
        report = _read_json(Path(tmp, "status"))
        stderr = _tail(Path(tmp, "stderr"))
    verdict = report.get("verdict")
    if verdict not in ("passed", "failed", "timeout", "error"):  # the bootstrap did not report
        return Outcome(None, f"the sandbox exited with status {proc.returncode} without a verdict", stderr)
    return Outcome(verdict, str(report.get("detail", "")), stderr)


def _finish(proc: subprocess.Popen, payload: bytes, limit: float) -> None:
    """Hand over the checks, wait for the bootstrap; past ``limit`` kill its group (and so its namespace)."""
    try:
        proc.communicate(payload, timeout=limit)
    except subprocess.TimeoutExpired:
        pass
    finally:
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # `unshare --kill-child` takes PID 1 and its namespace along
        proc.wait()


def _read_json(path: Path) -> dict:
    try:
        report = json.loads(path.read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return {}
    return report if isinstance(report, dict) else {}


def _tail(path: Path) -> str:
    with open(path, "rb") as handle:
        handle.seek(max(0, os.fstat(handle.fileno()).st_size - 4 * _STDERR_TAIL))
        return handle.read().decode("utf-8", "replace")[-_STDERR_TAIL:]
