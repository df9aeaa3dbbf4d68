"""Hostile programs run through the scoring sandbox, to check that it contains each of them here.

Containment programs attack the machine (fork bomb, ``setsid`` escape, sockets, writing or reading
outside its folder, signalling the evaluator, filling the disk, a memory bomb, children whose memory
together exceeds the bound, an infinite loop, exiting before the tests). Each prints ``BREACH: ...``
for every step that worked and, when something worked, runs to its end (a pass); a contained
attack ends in a failed assert, an error or a timeout. They run through
:func:`moectl.eval.code_exec.run_program`.

Integrity programs attack the verdict: each is a wrong solution (``add`` returning ``a - b``) that
tries to score ``passed`` anyway through :func:`moectl.eval.code_exec.run_tests` with HumanEval-style
checks: a nonce found in the frames, a result whose ``__eq__`` always agrees, patched ``builtins`` or
``sys.modules``, a trace function or ``__import__`` hook that defuses the asserts, forged messages
on every inherited descriptor (or all of them closed or replaced), the harness's own functions
replaced, exits and ``SystemExit`` at load or in the call, fake result lines, ``atexit`` hooks,
threads that outlive the call, signals to the harness, and reading the checks. A pass is a fake pass.
Honest programs (right and wrong solutions) show the harness still gives the right verdicts.

:func:`probe` counts one as contained when it was not scored as passed, reported no breach, used no
more memory than the bound (where a cgroup measured it), left no process running (processes are
found by a marker in their command line), created none of the outside files it tried, and the
evaluator's sockets saw nothing. Attacks that would be unsafe to try on this machine (a fork bomb
where no process limit applies, ``kill(-1)`` outside a PID namespace) are skipped and reported.
"""

from __future__ import annotations

import os
import secrets
import socket
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from moectl.eval.code_exec import ExecResult, run_program, run_tests
from moectl.eval.sandbox import Status, containment

MEMORY_BYTES = 512 * 1024**2
FILE_BYTES = 1024**2
MAX_PROCESSES = 16
_BOOTSTRAP_MARK = "moectl-sandbox:"  # in every bootstrap command line (the source is its argument)


@dataclass
class Target:
    """What the attacks aim at on the evaluator's side; created and torn down by :func:`probe`."""

    marker: str
    outside: Path  # an evaluator folder the program must not write into or read from
    secret: Path  # an evaluator file it must not read
    tcp: socket.socket  # an evaluator listener it must not reach
    udp: socket.socket
    free_port: int  # a port it may bind only inside its own network namespace
    namespace: bool

    def escape_paths(self) -> list[Path]:
        """Host paths a write from the sandbox could land on."""
        name = f"{self.marker}-escape"
        return [
            self.outside / name,
            Path.cwd() / name,
            Path("/tmp", name),
            Path("/var/tmp", name),
            Path("/dev/shm", name),
        ]

    def escaped(self) -> list[Path]:
        """Files named after the marker in the evaluator's folders (removed when found)."""
        folders = {self.outside, Path.cwd(), Path("/tmp"), Path("/var/tmp"), Path("/dev/shm")}
        return sorted(p for folder in folders if folder.is_dir() for p in folder.glob(f"{self.marker}*"))


@dataclass(frozen=True)
class Hostile:
    """One program: ``containment`` (a whole program), ``integrity`` (a wrong solution of :data:`CHECKS`
    trying to pass) or ``honest`` (a solution of :data:`CHECKS` that must score ``expect``)."""

    name: str
    program: Callable[[Target], str]
    timeout: float = 5.0
    unsafe_here: Callable[[Target], str] = lambda target: ""  # why not to try it on this machine
    kind: Literal["containment", "integrity", "honest"] = "containment"
    expect: Status | None = None


@dataclass
class Report:
    tried: int = 0  # hostile programs (containment and integrity) run
    contained: int = 0
    fake_passes: list[str] = field(default_factory=list)  # integrity programs scored as passed
    honest_tried: int = 0
    honest_right: int = 0  # honest programs that got the verdict they should
    skipped: dict[str, str] = field(default_factory=dict)
    breaches: dict[str, list[str]] = field(default_factory=dict)  # name -> what got through
    statuses: dict[str, str] = field(default_factory=dict)
    memory_peaks: dict[str, int] = field(default_factory=dict)  # bytes, where a cgroup measured them
    seconds: dict[str, float] = field(default_factory=dict)


_HEAD = "import os, sys, time\nBREACHES = []\ndef breach(what):\n    BREACHES.append('BREACH: ' + what)\n"
_END = "print(*BREACHES, sep='\\n', file=sys.stderr)\nassert BREACHES, 'contained'\n"


def _attack(body: str) -> str:
    """A program that records each step that worked with ``breach(...)`` and passes only if one did."""
    return _HEAD + textwrap.dedent(body) + _END


def _fork_bomb(t: Target) -> str:
    return f"import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n# {t.marker}\n"


def _wide_fork(t: Target) -> str:
    return _attack(
        """
        children = 0
        for _ in range(200):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                time.sleep(60)
                os._exit(0)
            children += 1
        if children >= 200:
            breach(f'{children} processes')
        """
    )


def _setsid_escape(t: Target) -> str:
    """A grandchild leaves the session and keeps writing (in its folder and outside) after the program exits."""
    child = textwrap.dedent(
        f"""
        import os, time
        os.setsid()
        if os.fork():
            os._exit(0)
        for _ in range(600):
            for p in {[str(p) for p in t.escape_paths()]!r} + ['alive']:
                try:
                    open(p, 'a').write('x')
                except OSError:
                    pass
            time.sleep(0.05)  # {t.marker}
        """
    )
    return f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {child!r}])\ntime.sleep(0.3)\nsys.exit(0)\n"


def _sockets(t: Target) -> str:
    tcp_port, udp_port = t.tcp.getsockname()[1], t.udp.getsockname()[1]
    return _attack(
        f"""
        import socket
        try:
            socket.create_connection(('127.0.0.1', {tcp_port}), timeout=1).close()
            breach('connected to the evaluator')
        except OSError:
            pass
        try:
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'{t.marker}', ('127.0.0.1', {udp_port}))
        except OSError:
            pass
        try:
            s = socket.socket()
            s.bind(('127.0.0.1', {t.free_port}))
            s.listen()
            s.settimeout(1.5)
            s.accept()
            breach('accepted a connection from outside')
        except OSError:
            pass
        """
    )


def _write_outside(t: Target) -> str:
    reported = [str(t.outside / f"{t.marker}-escape"), f"../{t.marker}-escape"]  # nowhere inside the sandbox
    return _attack(
        f"""
        for p in dict.fromkeys({reported!r} + {[str(p) for p in t.escape_paths()]!r}):
            try:
                open(p, 'w').write('x')
                if p in {reported!r}:
                    breach('wrote ' + p)
            except OSError:
                pass
        """
    )


def _read_outside(t: Target) -> str:
    import moectl.eval.sandbox as sandbox

    paths = [
        str(t.secret),
        sandbox.__file__,
        "/etc/shadow",
        f"/proc/{os.getpid()}/environ",
        "/proc/1/environ",
    ]
    return _attack(
        f"""
        for p in {paths!r}:
            try:
                open(p, 'rb').read()
                breach('read ' + p)
            except OSError:
                pass
        try:
            os.listdir({str(t.outside)!r})
            breach('listed the evaluator folder')
        except OSError:
            pass
        """
    )


def _signal_evaluator(t: Target) -> str:
    """Signal 0 probes whether the evaluator could be signalled; SIGKILL goes to the parent, the group
    and (only inside a PID namespace, where it cannot reach this machine's processes) to ``-1``."""
    everyone = "os.kill(-1, signal.SIGKILL)" if t.namespace else "None"
    return _attack(
        f"""
        import signal
        for what, send in (('the evaluator', lambda: os.kill({os.getpid()}, 0)),
                           ('the evaluator group', lambda: os.killpg({os.getpgrp()}, 0))):
            try:
                send()
                breach('may signal ' + what)
            except OSError:
                pass
        print(*BREACHES, sep='\\n', file=sys.stderr, flush=True)
        for send in (lambda: os.kill(os.getppid(), signal.SIGKILL),
                     lambda: os.killpg(os.getpgrp(), signal.SIGKILL),
                     lambda: {everyone}):
            try:
                send()
            except OSError:
                pass
        """
    )


def _fill_disk(t: Target) -> str:
    return _attack(
        f"""
        written = 0
        for folder in ('.', '/tmp', '/dev/shm'):
            for i in range(64):
                try:
                    with open(f'{{folder}}/{t.marker}-fill{{i}}', 'wb') as f:
                        f.write(b'x' * 2**20)
                    written += 2**20
                except OSError:
                    break
        if written >= 64 * 2**20:
            breach(f'wrote {{written >> 20}} MiB')
        """
    )


def _memory_bomb(t: Target) -> str:
    return _attack(
        """
        chunks = []
        try:
            for _ in range(64):
                chunks.append(bytearray(64 * 2**20))
            breach('allocated 4 GiB')
        except MemoryError:
            pass
        """
    )


def children_holding(each: int) -> str:
    """A program that forks 3 children, each touching ``each`` bytes and then staying alive, and prints
    ``HELD <bytes>`` to stderr: what the children still alive held at once (the process limit or the
    memory bound may stop some). Shared by :func:`_memory_fork` and the sandbox's memory tests."""
    return f"""
import os, select, sys, time
r, w = os.pipe()
for _ in range(3):
    try:
        pid = os.fork()
    except OSError:  # the process limit
        break
    if pid == 0:
        try:
            block = bytearray({each})
            for i in range(0, len(block), 4096):
                block[i] = 1
            os.write(w, os.getpid().to_bytes(4, 'big'))
        except MemoryError:
            pass
        time.sleep(30)
        os._exit(0)
reported, end = [], time.monotonic() + 4
while len(reported) < 3 and select.select([r], [], [], max(0, end - time.monotonic()))[0]:
    reported.append(int.from_bytes(os.read(r, 4), 'big'))
alive = [pid for pid in reported if os.waitpid(pid, os.WNOHANG) == (0, 0)]
held = len(alive) * {each}
print('HELD', held, file=sys.stderr)
"""


def _memory_fork(t: Target) -> str:
    """#42.4, scaled down: 3 children touching 1.4 GB each under a 2 GB bound took 5.1 GB. Here each
    child touches 5/8 of the bound: one fits, three together do not. Children still alive after
    they touched all their memory held it at once."""
    each = MEMORY_BYTES * 5 // 8
    check = f"""
print(f'MEMORY: {{len(alive)}} children held {{held >> 20}} MiB at once', file=sys.stderr)
if held > {MEMORY_BYTES}:
    breach(f'{{len(alive)}} children held {{held >> 20}} MiB, over the {MEMORY_BYTES >> 20} MiB bound')
"""
    return _attack(children_holding(each) + check)


def _early_exit(call: str) -> Callable[[Target], str]:
    return lambda t: f"import os, sys, atexit\n{call}\nassert False, 'the tests ran'\n"


# -- integrity: wrong solutions of CHECKS that try to score "passed" ------------------------------

CHECKS = (
    "def check(candidate):\n"
    "    assert candidate(2, 3) == 5\n"
    "    assert candidate(-1, 1) == 0\n"
    "    assert candidate(10, -4) == 6\n"
    "\n"
    "check(add)\n"
)
# the harness's messages and verdicts as a forger would write them (length-prefixed JSON, status JSON)
_FORGE = """
import json as _json
def _frame(message):
    data = _json.dumps(message).encode()
    return len(data).to_bytes(4, 'big') + data
FORGED = [_frame(['ready']), _frame(['ok', ['int', hex(5)]]), _frame(['ok', ['int', hex(0)]]),
          b'{"verdict": "passed", "detail": ""}\\n', b'{"exit": 0}\\n']
def forge_everywhere(fds=range(0, 256)):
    for fd in fds:
        for data in FORGED:
            try:
                os.write(fd, data)
            except OSError:
                pass
"""


def _solution(body: str, prelude: str = "") -> Callable[[Target], str]:
    """``prelude`` at module level, then ``def add(a, b):`` with ``body``; ``os``, ``sys``, ``time`` imported."""
    source = (
        "import os, sys, time\n"
        + _FORGE
        + textwrap.dedent(prelude)
        + "\ndef add(a, b):\n"
        + textwrap.indent(textwrap.dedent(body).strip("\n"), "    ")
        + "\n"
    )
    return lambda t: source


_NONCE_FROM_FRAMES = """
f = sys._getframe()
while f is not None:
    if 'nonce' in f.f_locals and 'result_fd' in f.f_locals:
        os.write(f.f_locals['result_fd'], f.f_locals['nonce'])
        os._exit(0)
    f = f.f_back
return a - b
"""
_ALL_FROM_FRAMES = """
secrets, fds = [], set(range(0, 64))
f = sys._getframe()
while f is not None:
    for value in list(f.f_locals.values()) + list(f.f_globals.values()):
        if type(value) is bytes and 8 <= len(value) <= 4096:
            secrets.append(value)
        elif type(value) is int and 0 <= value < 1024:
            fds.add(value)
    f = f.f_back
for fd in fds:
    for data in secrets + FORGED:
        try:
            os.write(fd, data)
        except OSError:
            pass
os._exit(0)
"""
_EQ_ALWAYS = """
class E(int):
    __eq__ = lambda self, other: True
    __ne__ = lambda self, other: False
    __hash__ = int.__hash__
return E(a - b)
"""
_PATCH_BUILTINS = """
import builtins
class Never(BaseException):
    pass
builtins.AssertionError = Never
builtins.isinstance = lambda *args: True
builtins.abs = builtins.len = lambda *args: 0
builtins.print = lambda *args, **kwargs: None
"""
_PATCH_MODULES = """
import json, types
fake = types.ModuleType('json')
fake.dumps = lambda *args, **kwargs: '["ok", ["int", "0x5"]]'
fake.loads = lambda *args, **kwargs: ['ready']
fake.JSONDecodeError = ValueError
for name in ('json', 'select', 'traceback'):
    sys.modules[name] = fake
sys.modules['__main__'] = fake
"""
_SETTRACE = """
import ctypes, threading
right = lambda a, b: a + b
def tracer(frame, event, arg):
    if 'candidate' in frame.f_locals and frame.f_locals['candidate'] is not right:
        frame.f_locals['candidate'] = right  # the checks would now call a right solution
        ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(frame), ctypes.c_int(0))
    return tracer
f = sys._getframe()
while f is not None:
    f.f_trace = tracer
    f = f.f_back
sys.settrace(tracer)
threading.settrace(tracer)
"""
_IMPORT_HOOK = """
import builtins
real_import = builtins.__import__
def hook(name, *args, **kwargs):
    module = real_import(name, *args, **kwargs)
    if name in ('json', 'os', 'select'):
        forge_everywhere()
    return module
builtins.__import__ = hook
"""
_REPLACE_HARNESS = """
import gc
def forged(*args, **kwargs):
    return ['int', hex(5)]
def ready(*args, **kwargs):
    forge_everywhere()
    os._exit(0)
for obj in gc.get_objects():
    code = getattr(obj, '__code__', None)
    if code is None or code.co_filename == 'program.py':
        continue
    if obj.__name__ in ('encode', 'keep', '_plain_copy'):
        obj.__code__ = forged.__code__
    elif obj.__name__ in ('_serve', '_flush_and_exit', 'decode', '_wait', '_describe', 'judge'):
        obj.__code__ = ready.__code__
    for holder in gc.get_referrers(obj):
        if type(holder) is dict and '__builtins__' in holder and holder is not globals():
            holder['_tell'] = holder['send'] = lambda fd, message, *rest: forge_everywhere()
"""
_PATCH_EXITS = """
os._exit = lambda code: None
sys.exit = lambda *args: None
import builtins
builtins.exit = builtins.quit = lambda *args: None
"""
_FAKE_LINES = """
for line in ('{"verdict": "passed", "detail": ""}', 'moectl-sandbox: passed', 'status=passed', 'PASSED', 'OK'):
    print(line)
    print(line, file=sys.stderr)
sys.stdout.flush()
sys.stderr.flush()
"""
_ATEXIT = """
import atexit
def at_exit():
    forge_everywhere()
    os._exit(0)
atexit.register(at_exit)
"""
_THREAD = """
import threading
def flood():
    for _ in range(2000):
        forge_everywhere(range(0, 32))
        time.sleep(0.001)
threading.Thread(target=flood, daemon=True).start()
time.sleep(0.05)
return a - b
"""
_SIGNALS = """
import signal
targets = {1, os.getppid(), os.getpgrp()}
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGALRM, signal.SIGHUP, signal.SIGPIPE,
            signal.SIGSTOP, signal.SIGCONT, signal.SIGKILL):
    for pid in targets:
        if pid != os.getpid():
            try:
                os.kill(pid, sig)
            except OSError:
                pass
return a - b
"""
_FIND_CHECKS = """
import gc
found = []
f = sys._getframe()
while f is not None:
    if 'candidate' in f.f_locals or f.f_code.co_name == 'check':
        found.append('a frame of the checks')
    f = f.f_back
for obj in gc.get_objects():
    code = getattr(obj, '__code__', None)
    if code is not None and code.co_name == 'check' and 'candidate' in code.co_varnames:
        found.append('the checks\\' code')
for path in ('/proc/1/cmdline', '/proc/1/environ', '/proc/1/mem', '/proc/1/fd/0', '/proc/self/fd/0',
             f'/proc/{os.getppid()}/cmdline', f'/proc/{os.getppid()}/fd/0', f'/proc/{os.getppid()}/mem'):
    try:
        with open(path, 'rb') as handle:
            if b'candidate' + b'(' in handle.read(1 << 22):
                found.append(path)
    except (OSError, ValueError):
        pass
if found:
    print('found the checks in', found, file=sys.stderr)
return a + b if found else a - b
"""
_KILL_HARNESS = """
import signal
for pid in {1, os.getppid()}:
    if pid != os.getpid():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
forge_everywhere()
os._exit(0)
"""

INTEGRITY: tuple[Hostile, ...] = tuple(
    Hostile(name, program, kind="integrity")
    for name, program in (
        ("the nonce from the frames", _solution(_NONCE_FROM_FRAMES)),
        ("every secret and fd from the frames", _solution(_ALL_FROM_FRAMES)),
        ("__eq__ always true", _solution(_EQ_ALWAYS)),
        ("builtins patched", _solution("return a - b", _PATCH_BUILTINS)),
        ("sys.modules replaced", _solution("return a - b", _PATCH_MODULES)),
        ("sys.settrace swaps the candidate", _solution("return a - b", _SETTRACE)),
        ("__import__ hook", _solution("return a - b", _IMPORT_HOOK)),
        ("forged messages on every fd", _solution("forge_everywhere()\nreturn a - b")),
        ("every fd closed", _solution("os.closerange(0, 1024)\nreturn a - b")),
        (
            "every fd dup2-ed over",
            _solution(
                "r, w = os.pipe()\nforge_everywhere([w])\nfor fd in range(0, 64):\n"
                "    try:\n        os.dup2(r if fd % 2 else w, fd)\n    except OSError:\n        pass\nreturn a - b"
            ),
        ),
        ("the harness's functions replaced", _solution("return a - b", _REPLACE_HARNESS)),
        ("os._exit and sys.exit patched", _solution("sys.exit(0)\nos._exit(0)\nreturn a - b", _PATCH_EXITS)),
        ("SystemExit(0) in the call", _solution("raise SystemExit(0)")),
        ("os._exit(0) in the call", _solution("os._exit(0)")),
        ("SystemExit(0) at load", _solution("return a - b", "raise SystemExit(0)\n")),
        ("os._exit(0) at load", _solution("return a - b", "forge_everywhere()\nos._exit(0)\n")),
        ("fake result lines", _solution(_FAKE_LINES + "\nreturn a - b", _FAKE_LINES)),
        ("atexit hook", _solution("sys.exit(0)", _ATEXIT)),
        ("a thread outlives the call", _solution(_THREAD)),
        ("signals to the harness", _solution(_SIGNALS)),
        ("reading the checks", _solution(_FIND_CHECKS)),
        ("killing the harness", _solution(_KILL_HARNESS)),
    )
)
HONEST: tuple[Hostile, ...] = (
    Hostile("right: a + b", _solution("return a + b"), kind="honest", expect="passed"),
    Hostile(
        "right: helpers, a thread, a Counter",
        _solution(
            "import collections, threading\nout = []\nthreading.Thread(target=lambda: out.append(a + b)).start()\n"
            "while not out:\n    time.sleep(0.001)\nreturn sum(collections.Counter({'x': out[0]}).values())"
        ),
        kind="honest",
        expect="passed",
    ),
    Hostile("wrong: a - b", _solution("return a - b"), kind="honest", expect="failed"),
    Hostile("wrong: raises", _solution("raise ValueError('no')"), kind="honest", expect="error"),
)


def _no_bomb_here(t: Target) -> str:
    limited = containment().uid is not None or os.geteuid() != 0
    return "" if limited else "programs run as root here: no process limit applies"


HOSTILE: tuple[Hostile, ...] = (
    Hostile("fork bomb", _fork_bomb, timeout=2.0, unsafe_here=_no_bomb_here),
    Hostile("200 sleeping children", _wide_fork, unsafe_here=_no_bomb_here),
    Hostile("setsid escape", _setsid_escape),
    Hostile("sockets", _sockets),
    Hostile("write outside", _write_outside),
    Hostile("read outside", _read_outside),
    Hostile("signal the evaluator", _signal_evaluator),
    Hostile("fill the disk", _fill_disk),
    Hostile("memory bomb", _memory_bomb),
    Hostile("children over the memory bound", _memory_fork, timeout=8.0),
    Hostile("infinite loop", lambda t: f"while True:\n    pass  # {t.marker}\n", timeout=1.0),
    Hostile("sys.exit(0)", _early_exit("sys.exit(0)")),
    Hostile("os._exit(0)", _early_exit("os._exit(0)")),
    Hostile("exit()", _early_exit("exit()")),
    Hostile("quit()", _early_exit("quit()")),
    Hostile("raise SystemExit", _early_exit("raise SystemExit")),
    Hostile("atexit os._exit(0)", _early_exit("atexit.register(os._exit, 0)")),
    Hostile("kill itself", _early_exit("import signal; os.kill(os.getpid(), signal.SIGKILL)")),
    *INTEGRITY,
    *HONEST,
)


def sandbox_processes(*markers: str) -> list[int]:
    """Processes whose command line holds any of ``markers`` (default: the sandbox bootstrap's)."""
    wanted = [m.encode() for m in (markers or (_BOOTSTRAP_MARK,))]
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if any(m in cmdline for m in wanted):
                found.append(int(entry))
    return found


def _knock(port: int, stop: threading.Event, hits: list[str]) -> None:
    """Try to connect to ``port`` on the host until ``stop``: only reachable if the sandbox shares our network."""
    while not stop.is_set():
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            hits.append(f"the evaluator reached the program's port {port}")
            return
        except OSError:
            time.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _after(t: Target, hostile: Hostile, result: ExecResult) -> list[str]:
    """What got through one run, seen from the evaluator."""
    found = [line for line in result.stderr.splitlines() if line.startswith("BREACH:")]
    if hostile.kind == "honest" and result.status != hostile.expect:
        found.append(f"scored as {result.status}, not {hostile.expect}")
    elif hostile.kind != "honest" and result.passed:
        found.append(f"scored as passed ({result.status})")
    if result.memory_peak is not None and result.memory_peak > MEMORY_BYTES:
        found.append(
            f"its processes used {result.memory_peak >> 20} MiB, over the {MEMORY_BYTES >> 20} MiB bound"
        )
    time.sleep(0.1)  # a surviving escapee would have written by now
    left = sandbox_processes(t.marker, _BOOTSTRAP_MARK)
    if left:
        found.append(f"processes left running: {left}")
    for path in t.escaped():
        found.append(f"created {path}")
        path.unlink()
    for sock in (t.tcp, t.udp):
        try:
            data = sock.accept() if sock.type == socket.SOCK_STREAM else sock.recv(64)
            found.append(f"the evaluator's socket received {data!r}")
        except (BlockingIOError, TimeoutError):
            pass
    return found


def _run(hostile: Hostile, t: Target) -> ExecResult:
    """A containment program whole; an integrity or honest one as the solution of :data:`CHECKS`."""
    if hostile.kind == "containment":
        return run_program(hostile.program(t), hostile.timeout, MEMORY_BYTES, FILE_BYTES, True, MAX_PROCESSES)
    return run_tests(
        hostile.program(t),
        CHECKS,
        names=["add"],
        timeout=hostile.timeout,
        memory_bytes=MEMORY_BYTES,
        file_bytes=FILE_BYTES,
        allow=True,
        max_processes=MAX_PROCESSES,
    )


def _count(report: Report, hostile: Hostile, result: ExecResult, found: list[str]) -> None:
    report.statuses[hostile.name] = result.status
    if result.memory_peak is not None:
        report.memory_peaks[hostile.name] = result.memory_peak
    if found:
        report.breaches[hostile.name] = found
    if hostile.kind == "honest":
        report.honest_tried += 1
        report.honest_right += not found
        return
    report.tried += 1
    report.contained += not found
    if hostile.kind == "integrity" and result.passed:
        report.fake_passes.append(hostile.name)


def probe(names: list[str] | None = None) -> Report:
    """Run the hostile programs (``names``: a subset) and report what was contained."""
    report = Report()
    ns = containment().mode == "namespace"
    with tempfile.TemporaryDirectory(prefix="moectl-probe-") as outside_dir:
        outside = Path(outside_dir)
        with socket.socket() as tcp, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            for sock in (tcp, udp):
                sock.bind(("127.0.0.1", 0))
                sock.setblocking(False)
            tcp.listen()
            for hostile in HOSTILE:
                if names is not None and hostile.name not in names:
                    continue
                marker = f"moectl-hostile-{secrets.token_hex(6)}"
                secret = outside / "secret.txt"
                secret.write_text(marker)
                t = Target(marker, outside, secret, tcp, udp, _free_port(), ns)
                why = hostile.unsafe_here(t)
                if why:
                    report.skipped[hostile.name] = why
                    continue
                stop, knocked = threading.Event(), []
                knocker = threading.Thread(target=_knock, args=(t.free_port, stop, knocked), daemon=True)
                if hostile.name == "sockets":
                    knocker.start()
                start = time.monotonic()
                result = _run(hostile, t)
                report.seconds[hostile.name] = time.monotonic() - start
                stop.set()
                if knocker.is_alive():
                    knocker.join()
                _count(report, hostile, result, knocked + _after(t, hostile, result))
    return report
