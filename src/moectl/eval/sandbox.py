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

Checked with moectl.eval.sandbox_check's hostile programs as root and as uid 1000 (all contained).

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
import secrets
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

MODE_VAR = "MOECTL_SANDBOX"
MODES = ("auto", "namespace", "basic")
NOBODY = 65534
BOOTSTRAP = Path(__file__).with_name("sandbox_bootstrap.py")
UNSHARE_FLAGS = ("--pid", "--fork", "--kill-child", "--net", "--mount", "--ipc", "--uts")
_STDERR_TAIL = 1000  # characters of stderr kept
_GRACE_S = 5.0  # beyond the program's timeout, for the bootstrap to report before it is killed


class SandboxUnavailableError(MoectlError, OSError):
    """``$MOECTL_SANDBOX=namespace`` was asked for and namespaces cannot be used here."""


@dataclass(frozen=True)
class Containment:
    """How programs are contained: ``mode``, the command prefix, the uid they run as (None: ours)."""

    mode: Literal["namespace", "basic"]
    prefix: tuple[str, ...]
    uid: int | None
    missing: str = ""  # what ``basic`` mode lacks, for the warning


@dataclass(frozen=True)
class Outcome:
    """What one run reported: ``exit`` code, ``signal`` or ``timeout``; ``finished``: the nonce came back."""

    finished: bool
    exit: int | None
    signal: int | None
    timeout: bool
    stderr: str


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
    return Containment("namespace", prefix, NOBODY if root else None)


def basic_mode(missing: str) -> Containment:
    """No namespaces; ``missing`` says why, for the warning."""
    root = os.geteuid() == 0
    drop = root and all(_readable_by_others(p) for p in (sys.base_prefix, sys.prefix, sys.executable))
    if root and not drop:
        missing += "; the Python installation is not readable by uid 65534, so programs run as root (no process limit)"
    return Containment("basic", (), NOBODY if drop else None, missing)


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
        if probe.finished and probe.exit == 0:
            return namespace_mode()
        why = f"`unshare` failed: {probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else probe}"
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
) -> Outcome:
    """Run ``program`` through the bootstrap under ``how`` (default: :func:`containment`)."""
    how = how or containment()
    nonce = secrets.token_hex(16).encode()
    with tempfile.TemporaryDirectory(prefix="moectl-exec-", ignore_cleanup_errors=True) as tmp:
        work, new_root = Path(tmp, "work"), Path(tmp, "root")
        work.mkdir()
        new_root.mkdir()
        (work / "program.py").write_text(program, encoding="utf-8")
        if how.uid is not None and how.mode == "basic":  # its cwd must be writable by it
            os.chown(work, how.uid, how.uid)
            os.chown(work / "program.py", how.uid, how.uid)
            os.chmod(tmp, 0o711)
        runs_as = how.uid if how.uid is not None else os.getuid()
        status_fd = os.open(Path(tmp, "status"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        config = {
            "mode": how.mode,
            "root": str(new_root),
            "binds": _bind_paths(),
            "uid": how.uid,
            "gid": how.uid,
            "status_fd": status_fd,
            "timeout": timeout,
            "disk_bytes": max(4 * file_bytes, 1024**2),
            "block_sockets": how.mode == "basic",
            "limits": {
                "memory_bytes": memory_bytes,
                "cpu_seconds": int(timeout) + 2,
                "file_bytes": file_bytes,
                "processes": _processes_of(runs_as) + max_processes,
            },
        }
        command = [
            *how.prefix,
            sys.executable,
            "-I",
            "-c",
            BOOTSTRAP.read_text(encoding="utf-8"),
            json.dumps(config),
        ]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
        try:
            with open(Path(tmp, "result"), "wb") as out, open(Path(tmp, "stderr"), "wb") as err:
                os.chmod(out.name, 0o600)
                try:
                    proc = subprocess.Popen(
                        command,
                        cwd=work,
                        env=env,
                        stdin=subprocess.PIPE,
                        stdout=out,
                        stderr=err,
                        pass_fds=(status_fd,),
                        start_new_session=True,
                        close_fds=True,
                    )
                except OSError as exc:
                    return Outcome(False, None, None, False, f"could not start the sandbox: {exc}")
                _finish(proc, nonce, timeout + _GRACE_S)
        finally:
            os.close(status_fd)
        report = _read_json(Path(tmp, "status"))
        finished = Path(tmp, "result").read_bytes().find(nonce) >= 0
        stderr = _tail(Path(tmp, "stderr"))
    if not report:  # the bootstrap did not report: it failed to set up, or was killed
        return Outcome(
            False, None, None, False, stderr or f"the sandbox exited with status {proc.returncode}"
        )
    if "exit" not in report:
        finished = False
    return Outcome(finished, report.get("exit"), report.get("signal"), bool(report.get("timeout")), stderr)


def _finish(proc: subprocess.Popen, nonce: bytes, limit: float) -> None:
    """Hand over the nonce, wait for the bootstrap; past ``limit`` kill its group (and so its namespace)."""
    with suppress(BrokenPipeError):
        assert proc.stdin is not None
        proc.stdin.write(nonce)
    with suppress(BrokenPipeError):
        proc.stdin.close()
    try:
        proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        pass
    finally:
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # `unshare --kill-child` takes PID 1 and its namespace along
        proc.wait()


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return {}


def _tail(path: Path) -> str:
    with open(path, "rb") as handle:
        handle.seek(max(0, os.fstat(handle.fileno()).st_size - 4 * _STDERR_TAIL))
        return handle.read().decode("utf-8", "replace")[-_STDERR_TAIL:]
