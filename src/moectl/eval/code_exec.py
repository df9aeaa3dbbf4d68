"""Run model-written programs for functional-correctness benchmarks (HumanEval, MBPP), and pass@k.

HumanEval (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", §2) and MBPP
(Austin et al. 2021, "Program Synthesis with Large Language Models", §2) score a completion by
executing it against the problem's unit tests. Chen et al. warn that this runs untrusted code and
ask harnesses to make execution an explicit opt-in; moectl does so: nothing runs unless
``$MOECTL_ALLOW_CODE_EXEC=1`` or ``allow=True`` is given (``moectl eval --allow-code-exec``).

Each program runs in a fresh ``python -I`` process through moectl.eval.sandbox: where ``unshare``
works, in its own PID, network, mount, IPC and UTS namespaces, in a new root with a size-capped
tmpfs as its only writable place, as uid 65534 when the evaluator is root, under resource limits
(CPU seconds, written-file size, open files, processes, no core files), one memory bound for all its
processes together (a per-program cgroup, else processes x address space) and a wall-clock timeout;
everything it started dies with it.

:func:`run_tests` scores: the solution runs in that process, but the tests run outside it, in the
sandbox's harness, and call the solution's functions over a pipe with plain values only (exact
builtin types), so a completion cannot make its own verdict (write a nonce, patch ``assert``, exit
early) nor pass with a result whose ``__eq__`` always agrees (issue #42.5; HumanEval's own harness has
both weaknesses). :func:`run_program` runs a whole program, tests included, in the program's process:
it passes when the program runs to its end, which a hostile program can always arrange, so it is
for trusted programs and containment checks, not for scoring. This is damage limitation, not a
proven security boundary: run untrusted models' code inside a container or VM.
"""

from __future__ import annotations

import ast
import builtins
import math
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from moectl.errors import ConfigError, MoectlError
from moectl.eval.sandbox import Checks, Outcome, Status, containment, launch

ENV_VAR = "MOECTL_ALLOW_CODE_EXEC"
MIN_MEMORY_BYTES = 64 * 1024**2  # below this a Python process cannot start


class CodeExecutionNotAllowedError(MoectlError, PermissionError):
    """Executing generated code was not opted into; the message names the switch."""


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one program.

    ``status``: ``passed`` (every check held; :func:`run_program`: it ran to its end), ``failed`` (an
    ``assert`` failed, or a checked result was not a plain value), ``timeout`` (killed at the wall-clock
    limit), ``error`` (any other exception, an exit or crash, or a resource limit). ``memory_peak``: the
    most memory the program's processes used at once, in bytes, where a cgroup measured it.
    """

    passed: bool
    status: Status
    stderr: str = ""
    memory_peak: int | None = None


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


def _result(outcome: Outcome, timeout: float) -> ExecResult:
    """The harness's verdict, with its reason after the program's stderr."""
    stderr = outcome.stderr
    if outcome.verdict is None:
        return ExecResult(False, "error", (stderr + "\n" + outcome.detail).strip(), outcome.memory_peak)
    detail = outcome.detail or (f"timed out after {timeout:g} s" if outcome.verdict == "timeout" else "")
    if detail:
        stderr = (stderr.rstrip("\n") + "\nmoectl-sandbox: " + detail).lstrip("\n")
    return ExecResult(outcome.verdict == "passed", outcome.verdict, stderr, outcome.memory_peak)


def _check_limits(timeout: float, memory_bytes: int, file_bytes: int, max_processes: int) -> None:
    """Refuse limits no program could run under, naming the one at fault."""
    if not timeout > 0:
        raise ConfigError(f"timeout must be above 0 seconds, got {timeout!r}")
    if memory_bytes < MIN_MEMORY_BYTES:
        raise ConfigError(f"memory_bytes must be at least {MIN_MEMORY_BYTES} (64 MiB), got {memory_bytes!r}")
    if file_bytes < 1:
        raise ConfigError(f"file_bytes must be at least 1, got {file_bytes!r}")
    if max_processes < 1:
        raise ConfigError(f"max_processes must be at least 1, got {max_processes!r}")


def run_program(
    program: str,
    timeout: float = 10.0,
    memory_bytes: int = 2 * 1024**3,
    file_bytes: int = 16 * 1024**2,
    allow: bool | None = None,
    max_processes: int = 64,
) -> ExecResult:
    """Execute ``program`` (Python source) in the sandbox; ``passed`` means it ran to its end.

    Not for scoring untrusted code against tests (use :func:`run_tests`): whatever runs in the
    program's process can also claim to have reached its end. An exit, ``os._exit`` or an exception
    before the end is not a pass. Refuses (:class:`CodeExecutionNotAllowedError`) unless
    ``allow=True`` or ``$MOECTL_ALLOW_CODE_EXEC=1``. stdout is discarded; the last characters of
    stderr are kept. ``memory_bytes`` bounds all the program's processes together; ``file_bytes``
    caps each written file (the program's tmpfs holds four times that); ``max_processes`` caps the
    processes it may add (:data:`moectl.eval.sandbox_cgroup.FALLBACK_PROCESSES` without a cgroup).
    """
    require_allowed(allow)
    _check_limits(timeout, memory_bytes, file_bytes, max_processes)
    return _result(launch(program, timeout, memory_bytes, file_bytes, max_processes), timeout)


def run_tests(
    solution: str,
    tests: str,
    context: str = "",
    names: Sequence[str] | None = None,
    timeout: float = 10.0,
    memory_bytes: int = 2 * 1024**3,
    file_bytes: int = 16 * 1024**2,
    allow: bool | None = None,
    max_processes: int = 64,
) -> ExecResult:
    """Score ``solution`` (untrusted source) against ``tests`` (trusted), which run outside its process.

    The solution runs to its end in the sandboxed process; then ``context`` (trusted code the tests
    rely on, e.g. HumanEval's prompt with its helper functions) and ``tests`` run in the harness, where
    each of ``names`` (default :func:`solution_names`) calls the solution's function of that name.
    Arguments and results cross as plain values (exact int, float, complex, str, bytes, bool, None
    and list/tuple/set/frozenset/dict of them); a result that is not plain may be passed back but
    not compared (``failed``). ``passed`` only when the tests ran to their end. Limits and opt-in as
    :func:`run_program`.
    """
    require_allowed(allow)
    _check_limits(timeout, memory_bytes, file_bytes, max_processes)
    taken = tuple(solution_names(tests, context) if names is None else names)
    bad = [name for name in taken if not isinstance(name, str) or not name.isidentifier()]
    if bad:
        raise ConfigError(f"names must be Python identifiers, got {bad[0]!r}")
    checks = Checks(tests, context, taken, tuple(_standard_modules(tests, context, taken)))
    return _result(launch(solution, timeout, memory_bytes, file_bytes, max_processes, checks=checks), timeout)


def _parse(source: str, what: str) -> ast.Module:
    try:
        return ast.parse(source)
    except SyntaxError as exc:
        raise ConfigError(f"the {what} do not parse: {exc.msg} (line {exc.lineno})") from None


def _bound(tree: ast.Module) -> set[str]:
    """Names ``tree`` binds anywhere: assignments, definitions, imports, arguments."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return bound


def _free(tests: str, context: str) -> list[str]:
    """Names the tests read that neither they nor ``context`` bind, in order of appearance."""
    tree = _parse(tests, "tests")
    bound = _bound(tree) | _bound(_parse(context, "context"))
    read = [
        node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
    ]
    return [name for name in dict.fromkeys(read) if name not in bound]


def solution_names(tests: str, context: str = "", also: Iterable[str] = ()) -> list[str]:
    """The names ``tests`` take from the solution: those they read that they, ``context`` and the
    builtins do not define and that name no standard module, plus those of ``also`` they read (a
    solution may shadow a builtin: MBPP task 126 tests a function named ``sum``)."""
    also = set(also)
    return [
        name
        for name in _free(tests, context)
        if name in also or not (hasattr(builtins, name) or name in sys.stdlib_module_names)
    ]


def _standard_modules(tests: str, context: str, names: Sequence[str]) -> list[str]:
    """Standard modules the tests read without importing them (the solution's imports are not theirs)."""
    return [n for n in _free(tests, context) if n in sys.stdlib_module_names and n not in names]


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
