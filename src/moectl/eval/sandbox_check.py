"""Hostile programs run through the scoring sandbox, to check that it contains each of them here.

Each program attacks one thing (fork bomb, ``setsid`` escape, sockets, writing or reading outside
its folder, signalling the evaluator, filling the disk, a memory bomb, an infinite loop, exiting
before the tests). It prints ``BREACH: ...`` for every step that worked and, when something worked,
runs to its end (a pass); a contained attack ends in a failed assert, an error or a timeout.
:func:`probe` runs them through :func:`moectl.eval.code_exec.run_program` and counts one as
contained when it was scored as failed, reported no breach, left no process running (processes
are found by a marker in their command line), created none of the outside files it tried, and the
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

from moectl.eval.code_exec import ExecResult, run_program
from moectl.eval.sandbox import containment

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
    name: str
    program: Callable[[Target], str]
    timeout: float = 5.0
    unsafe_here: Callable[[Target], str] = lambda target: ""  # why not to try it on this machine


@dataclass
class Report:
    tried: int = 0
    contained: int = 0
    skipped: dict[str, str] = field(default_factory=dict)
    breaches: dict[str, list[str]] = field(default_factory=dict)  # name -> what got through
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


def _early_exit(call: str) -> Callable[[Target], str]:
    return lambda t: f"import os, sys, atexit\n{call}\nassert False, 'the tests ran'\n"


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
    Hostile("infinite loop", lambda t: f"while True:\n    pass  # {t.marker}\n", timeout=1.0),
    Hostile("sys.exit(0)", _early_exit("sys.exit(0)")),
    Hostile("os._exit(0)", _early_exit("os._exit(0)")),
    Hostile("exit()", _early_exit("exit()")),
    Hostile("quit()", _early_exit("quit()")),
    Hostile("raise SystemExit", _early_exit("raise SystemExit")),
    Hostile("atexit os._exit(0)", _early_exit("atexit.register(os._exit, 0)")),
    Hostile("kill itself", _early_exit("import signal; os.kill(os.getpid(), signal.SIGKILL)")),
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


def _after(t: Target, result: ExecResult) -> list[str]:
    """What got through one run, seen from the evaluator."""
    found = [line for line in result.stderr.splitlines() if line.startswith("BREACH:")]
    if result.passed:
        found.append(f"scored as passed ({result.status})")
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
                result = run_program(
                    hostile.program(t),
                    timeout=hostile.timeout,
                    memory_bytes=MEMORY_BYTES,
                    file_bytes=FILE_BYTES,
                    allow=True,
                    max_processes=MAX_PROCESSES,
                )
                report.seconds[hostile.name] = time.monotonic() - start
                stop.set()
                if knocker.is_alive():
                    knocker.join()
                found = knocked + _after(t, result)
                report.tried += 1
                if found:
                    report.breaches[hostile.name] = found
                else:
                    report.contained += 1
    return report
