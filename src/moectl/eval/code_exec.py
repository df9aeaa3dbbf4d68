"""Run model-written programs for functional-correctness benchmarks (HumanEval, MBPP), and pass@k.

HumanEval (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", §2) and MBPP
(Austin et al. 2021, "Program Synthesis with Large Language Models", §2) score a completion by
executing it against the problem's unit tests. Chen et al. warn that this runs untrusted code and
ask harnesses to make execution an explicit opt-in; moectl does so: nothing runs unless
``$MOECTL_ALLOW_CODE_EXEC=1`` or ``allow=True`` is given (``moectl eval --allow-code-exec``).

Each program runs in a fresh ``python -I`` process (isolated mode: no ``PYTHON*`` variables, no user
site, no current directory on ``sys.path``) inside an empty temporary directory, with stdin closed,
a minimal environment, its own session (the whole process group is killed afterwards), a
wall-clock timeout and ``setrlimit`` limits on address space, CPU seconds, core files, written file
size and open files. This is damage limitation, not a security boundary: run untrusted models'
code inside a container or VM.
"""

from __future__ import annotations

import math
import os
import resource
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

ENV_VAR = "MOECTL_ALLOW_CODE_EXEC"
Status = Literal["passed", "failed", "timeout", "error"]
_STDERR_TAIL = 1000  # characters of stderr kept in the result


class CodeExecutionNotAllowedError(PermissionError):
    """Executing generated code was not opted into; the message names the switch."""


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one program.

    ``status``: ``passed`` (exit 0), ``failed`` (a test's ``assert`` failed), ``timeout`` (killed at
    the wall-clock limit), ``error`` (any other exception, a crash, or a resource limit).
    """

    passed: bool
    status: Status
    stderr: str = ""


def exec_allowed(allow: bool | None = None) -> bool:
    """Whether execution is opted into: ``allow`` if given, else ``$MOECTL_ALLOW_CODE_EXEC == "1"``."""
    return bool(allow) if allow is not None else os.environ.get(ENV_VAR, "") == "1"


def require_allowed(allow: bool | None = None) -> None:
    """Raise :class:`CodeExecutionNotAllowedError` unless execution is opted into."""
    if not exec_allowed(allow):
        raise CodeExecutionNotAllowedError(
            "this evaluation executes model-generated Python code (HumanEval/MBPP pass@k), which is "
            f"off by default: set {ENV_VAR}=1 (or pass --allow-code-exec to `moectl eval`, or "
            "allow=True from Python) to opt in, ideally inside a container or VM"
        )


def code_exec_tasks(tasks: Sequence[str]) -> list[str]:
    """The shipped tasks among ``tasks`` (groups expanded) that execute code (``metadata.executes_code``)."""
    from moectl.eval.lm_tasks import _leaves, resolve_tasks, task_configs

    configs = task_configs()
    leaves = [leaf for name in resolve_tasks(list(tasks)) for leaf in _leaves(name, configs)]
    return [leaf for leaf in dict.fromkeys(leaves) if configs[leaf].get("metadata", {}).get("executes_code")]


def check_code_tasks(tasks: Sequence[str], allow: bool | None = None) -> None:
    """Refuse up front (before a model is loaded) if any of ``tasks`` executes code without opt-in."""
    if code_exec_tasks(tasks):
        require_allowed(allow)


@contextmanager
def code_exec_allowed(enabled: bool = True) -> Iterator[None]:
    """Set ``$MOECTL_ALLOW_CODE_EXEC=1`` for the block when ``enabled`` (restored afterwards)."""
    if not enabled:
        yield
        return
    before = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = before


def _limits(cpu_seconds: int, memory_bytes: int, file_bytes: int) -> Callable[[], None]:
    """A ``preexec_fn`` applying the resource limits in the child before ``exec``."""

    def apply() -> None:
        for name, value in (
            (resource.RLIMIT_AS, memory_bytes),
            (resource.RLIMIT_CPU, cpu_seconds),
            (resource.RLIMIT_CORE, 0),
            (resource.RLIMIT_FSIZE, file_bytes),
            (resource.RLIMIT_NOFILE, 64),
        ):
            hard = resource.getrlimit(name)[1]
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(name, (value, value))

    return apply


def _kill_group(proc: subprocess.Popen) -> None:
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _classify(returncode: int, stderr: str) -> Status:
    if returncode == 0:
        return "passed"
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    return "failed" if last.startswith("AssertionError") else "error"


def run_program(
    program: str,
    timeout: float = 10.0,
    memory_bytes: int = 2 * 1024**3,
    file_bytes: int = 16 * 1024**2,
    allow: bool | None = None,
) -> ExecResult:
    """Execute ``program`` (Python source) in a sandboxed subprocess; ``passed`` means exit status 0.

    Refuses (:class:`CodeExecutionNotAllowedError`) unless ``allow=True`` or
    ``$MOECTL_ALLOW_CODE_EXEC=1``. stdout is discarded; the last characters of stderr are kept.
    """
    require_allowed(allow)
    with tempfile.TemporaryDirectory(prefix="moectl-exec-", ignore_cleanup_errors=True) as tmp:
        root = Path(tmp)
        (root / "program.py").write_text(program, encoding="utf-8")
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": tmp, "TMPDIR": tmp}
        with open(root / "stderr.txt", "wb") as err:
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "program.py"],
                    cwd=tmp,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    preexec_fn=_limits(math.ceil(timeout) + 1, memory_bytes, file_bytes),
                    start_new_session=True,
                    close_fds=True,
                )
            except OSError as exc:
                return ExecResult(False, "error", f"could not start the interpreter: {exc}")
            try:
                returncode: int | None = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                returncode = None
            finally:
                _kill_group(proc)  # the program's own children too
                proc.wait()
        with open(root / "stderr.txt", "rb") as handle:
            handle.seek(max(0, os.fstat(handle.fileno()).st_size - 4 * _STDERR_TAIL))
            tail = handle.read().decode("utf-8", "replace")[-_STDERR_TAIL:]
    if returncode is None:
        return ExecResult(False, "timeout", tail or f"timed out after {timeout:g} s")
    status = _classify(returncode, tail)
    if returncode < 0 and not tail:
        tail = f"killed by signal {-returncode}"
    return ExecResult(status == "passed", status, tail)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` passed (Chen et al. 2021, eq. 1).

    ``1 - C(n-c, k) / C(n, k)``, computed as ``1 - prod_{i=n-c+1..n} (1 - k/i)`` for stability.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_pass_at_k(ns: Sequence[int], cs: Sequence[int], k: int) -> float:
    """Mean of :func:`pass_at_k` over problems (sample counts ``ns``, correct counts ``cs``)."""
    if len(ns) != len(cs) or not ns:
        raise ValueError("ns and cs must be non-empty and of equal length")
    return sum(pass_at_k(n, c, k) for n, c in zip(ns, cs, strict=True)) / len(ns)
