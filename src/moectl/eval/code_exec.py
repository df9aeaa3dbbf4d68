"""Run model-written programs for functional-correctness benchmarks (HumanEval, MBPP), and pass@k.

HumanEval (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", §2) and MBPP
(Austin et al. 2021, "Program Synthesis with Large Language Models", §2) score a completion by
executing it against the problem's unit tests. Chen et al. warn that this runs untrusted code and
ask harnesses to make execution an explicit opt-in; moectl does so: nothing runs unless
``$MOECTL_ALLOW_CODE_EXEC=1`` or ``allow=True`` is given (``moectl eval --allow-code-exec``).

Each program runs in a fresh ``python -I`` process through moectl.eval.sandbox: where ``unshare``
works, in its own PID, network, mount, IPC and UTS namespaces, in a new root with a size-capped
tmpfs as its only writable place, as uid 65534 when the evaluator is root, under resource limits
(address space, CPU seconds, written-file size, open files, processes, no core files) and a
wall-clock timeout; everything it started dies with it. A completion passes only when the program
runs to its end: the bootstrap then writes a per-run nonce, so ``sys.exit(0)``/``exit()``/
``os._exit(0)`` before the tests is a failure, not a pass. This is damage limitation, not a proven
security boundary: run untrusted models' code inside a container or VM.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

from moectl.errors import MoectlError
from moectl.eval.sandbox import Outcome, containment, launch

ENV_VAR = "MOECTL_ALLOW_CODE_EXEC"
Status = Literal["passed", "failed", "timeout", "error"]


class CodeExecutionNotAllowedError(MoectlError, PermissionError):
    """Executing generated code was not opted into; the message names the switch."""


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one program.

    ``status``: ``passed`` (ran to its end, exit 0), ``failed`` (a test's ``assert`` failed), ``timeout`` (killed at
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
    """Refuse up front (before a model is loaded) if any of ``tasks`` executes code without opt-in.

    Also settles the sandbox's containment then: a bad ``$MOECTL_SANDBOX`` or an unavailable
    ``namespace`` mode fails here, and the basic-mode warning comes before the run.
    """
    if code_exec_tasks(tasks):
        require_allowed(allow)
        containment()


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


def _classify(outcome: Outcome) -> tuple[Status, str]:
    """``passed`` only when the program ran to its end (the nonce came back) and exited 0."""
    stderr = outcome.stderr
    if outcome.timeout:
        return "timeout", stderr
    if outcome.finished and outcome.exit == 0:
        return "passed", stderr
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if outcome.signal is not None and not stderr:
        stderr = f"killed by signal {outcome.signal}"
    elif outcome.exit == 0 and not outcome.finished and "moectl-sandbox:" not in stderr:
        stderr = (stderr + "\nexited with status 0 before the end of the program: not a pass").lstrip()
    return ("failed" if last.startswith("AssertionError") else "error"), stderr


def run_program(
    program: str,
    timeout: float = 10.0,
    memory_bytes: int = 2 * 1024**3,
    file_bytes: int = 16 * 1024**2,
    allow: bool | None = None,
    max_processes: int = 64,
) -> ExecResult:
    """Execute ``program`` (Python source) in the sandbox; ``passed`` means it ran to its end and exited 0.

    Refuses (:class:`CodeExecutionNotAllowedError`) unless ``allow=True`` or
    ``$MOECTL_ALLOW_CODE_EXEC=1``. stdout is discarded; the last characters of stderr are kept.
    ``file_bytes`` caps each written file (the program's tmpfs holds four times that);
    ``max_processes`` caps the processes it may add.
    """
    require_allowed(allow)
    outcome = launch(program, timeout, memory_bytes, file_bytes, max_processes)
    status, stderr = _classify(outcome)
    if status == "timeout":
        stderr = stderr or f"timed out after {timeout:g} s"
    return ExecResult(status == "passed", status, stderr)


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
