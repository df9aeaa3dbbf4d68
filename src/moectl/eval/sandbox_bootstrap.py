"""The first Python code a sandboxed program's process runs (``python -I -c <this file> <config>``).

moectl.eval.sandbox starts this file's source as the child's entry point (never ``preexec_fn``,
which is unsafe in a threaded evaluator) and it, not the evaluator, sets the child up:

1. in ``namespace`` mode (started under ``unshare --pid --fork --kill-child --net --mount ...``, so this
   process is PID 1 of a new PID namespace, with no network but a down loopback) builds a new root:
   a small tmpfs holding read-only binds of the system and Python directories, a private ``/proc``,
   a minimal ``/dev`` and one size-capped tmpfs for the program's files (``/sandbox``, also ``/tmp``),
   then ``pivot_root``s into it so nothing of the evaluator's filesystem stays reachable; in either
   mode it makes itself non-dumpable, so its memory cannot be read through ``/proc`` or ``ptrace``;
2. forks the program's process, which joins the program's cgroup (moectl.eval.sandbox_cgroup) where
   there is one, applies the resource limits (address space, CPU seconds, written-file size, open
   files, processes, no core files), drops to an unprivileged uid when the evaluator is root, sets
   ``no_new_privs``, executes ``program.py`` as ``__main__`` and then answers calls (below);
3. only then reads the checks from stdin, runs them here, in this process, and writes one JSON
   verdict (``passed``/``failed``/``error``/``timeout`` and why) to the status descriptor. In
   ``namespace`` mode this process's exit takes every process of the namespace with it (``setsid``
   does not escape); in ``basic`` mode it is a child subreaper and kills all its descendants.

Why the verdict cannot be forged (issue #42.5). The program owns its whole process: it can walk
``sys._getframe()`` and ``gc``, patch ``builtins``, ``sys.modules``, ``sys.settrace``, ``__import__``,
``os._exit`` or this file's functions, write to or close any descriptor it inherited, print, exit,
start threads or ``atexit`` hooks. So nothing in that process decides anything:

- the checks (the problem's asserts, and trusted context such as HumanEval's prompt with its helper
  functions) run in this process, the harness, and the program never sees them: they stay unread on
  stdin until the program's process exists, and it gets ``/dev/null`` instead, so they are not in its
  copy of this process's memory either. This process is non-dumpable, so the program cannot read
  its memory or descriptors; it cannot signal it either when it runs as uid 65534 or inside the PID
  namespace (where PID 1 gets no signal it has no handler for), and killing it would leave no
  verdict, an ``error``;
- the program's process only answers calls, one at a time over a pipe: "call NAME (one of the
  solution's functions) with these arguments" -> "returned this" or "raised that". What crosses is
  plain data, built here from JSON with exact builtin types (int, float, complex, str, bytes, bool,
  None, and list/tuple/set/frozenset/dict of them, :func:`encode`), so the asserts compare the
  harness's own objects and no method of the program's runs here. A result that is not plain (a
  ``class E(int)`` whose ``__eq__`` always agrees, an object, a generator) stays in the program's
  process as a :class:`Remote` handle: the checks may pass it back in a call, but comparing it,
  testing its truth or doing arithmetic with it raises :class:`NotPlainError`, a failed check;
- the verdict is written here, to a descriptor the program's process never had, after the checks
  ran to their end. An exit, a crash or a malformed reply from the program is an ``error``, a wrong
  value a ``failed`` assert: whatever the program sends, all it chooses is what its functions return.

None of this holds in ``basic`` mode run by a non-root user: the program then runs as the evaluator's
own uid, without namespaces, and could write the status file or attack the evaluator itself.

Standard library only, and no moectl imports: it runs with ``-I`` inside the new root.
"""

import builtins
import contextlib
import ctypes
import importlib
import json
import os
import resource
import select
import signal
import sys
import time
import traceback
import types

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 32, 1024, 2048, 4096
MS_REC, MS_PRIVATE, MS_RELATIME = 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_CHILD_SUBREAPER = 4, 24, 28, 36
PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 47, 4
# SECBIT_NOROOT (+ locked): uid 0 gains no capabilities on exec; KEEP_CAPS and ambient raising locked off
SECURE_BITS = 0b11 | 0b100000 | 0b11000000
CAPABILITY_VERSION_3 = 0x20080522
# pivot_root has no glibc wrapper; its syscall number per architecture (else: chroot, see _enter_root)
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
SANDBOX = "/sandbox"

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encode = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(
        _libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data)),
        f"mount {target}",
    )


def _kept_flags(path: str) -> int:
    """The mount flags of ``path`` a read-only remount must repeat (a user namespace may not drop them)."""
    f = os.statvfs(path).f_flag
    kept = f & (MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME)  # ST_* equal MS_* here
    return kept | (MS_RELATIME if f & os.ST_RELATIME else 0)


def _bind(source: str, target: str, readonly: bool = True, strict: bool = False) -> None:
    """Bind ``source`` at ``target`` (created to match: a directory or an empty file), read-only.

    ``strict``: fail when it cannot be made read-only (the program runs as the evaluator's uid).
    """
    if os.path.isdir(source):
        os.makedirs(target, mode=0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        open(target, "a").close()
    _mount(source, target, None, MS_BIND | MS_REC)
    if readonly:
        try:
            _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | _kept_flags(source))
        except OSError:
            if strict:
                raise


def _build_root(config: dict) -> None:
    """Mount the new root at ``config['root']``, copy ``program.py`` into its ``/sandbox`` and enter it."""
    new = config["root"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the evaluator
    _mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=755")
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        if os.path.islink("/" + name):
            os.symlink(os.readlink("/" + name), os.path.join(new, name))
    for path in config["binds"]:
        if os.path.exists(path):
            _bind(path, new + path, strict=config["uid"] is None)
    os.makedirs(new + "/dev/shm", mode=0o755)
    _mount("tmpfs", new + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=1777")  # semaphores
    for device in ("null", "zero", "full", "random", "urandom"):
        _bind("/dev/" + device, new + "/dev/" + device, readonly=False)
    os.symlink("/proc/self/fd", new + "/dev/fd")
    os.makedirs(new + "/proc")
    _mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.makedirs(new + SANDBOX)
    _mount("tmpfs", new + SANDBOX, "tmpfs", MS_NOSUID | MS_NODEV, f"size={config['disk_bytes']},mode=700")
    if not os.path.lexists(new + "/tmp"):  # a bound Python installation may live under /tmp (a venv there)
        os.symlink(SANDBOX, new + "/tmp")
    with open("program.py", "rb") as src, open(new + SANDBOX + "/program.py", "wb") as dst:
        dst.write(src.read())
    if config["uid"] is not None:
        os.chown(new + SANDBOX, config["uid"], config["gid"])
        os.chown(new + SANDBOX + "/program.py", config["uid"], config["gid"])
    _enter_root(new)
    os.chdir(SANDBOX)


def _enter_root(new: str) -> None:
    """``pivot_root`` into ``new`` and detach the old root (unreachable afterwards); ``chroot`` elsewhere."""
    number = PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        os.chroot(new)  # escapable only with CAP_SYS_CHROOT, which the unprivileged program lacks
        return
    os.makedirs(new + "/.old")
    _check(_libc.syscall(ctypes.c_long(number), new.encode(), (new + "/.old").encode()), "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.old", ctypes.c_int(MNT_DETACH)), "umount old root")
    os.rmdir("/.old")
    # not allowed in some user namespaces; the unprivileged program cannot write there anyway
    with contextlib.suppress(OSError):
        _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4m,mode=755")


def _limit_and_drop(config: dict) -> None:
    """Resource limits, then the unprivileged uid (root in the sandbox would ignore ``RLIMIT_NPROC``)."""
    limits = config["limits"]
    for name, value in (
        (resource.RLIMIT_AS, limits["memory_bytes"]),
        (resource.RLIMIT_CPU, limits["cpu_seconds"]),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_FSIZE, limits["file_bytes"]),
        (resource.RLIMIT_NOFILE, 64),
        (resource.RLIMIT_NPROC, limits["processes"]),
    ):
        hard = resource.getrlimit(name)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(name, (value, value))
    if config["uid"] is not None:
        os.setgroups([])
        os.setresgid(config["gid"], config["gid"], config["gid"])
        os.setresuid(config["uid"], config["uid"], config["uid"])  # clears every capability
    else:
        _drop_capabilities()
    _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _drop_capabilities() -> None:
    """Keep the uid but lose every capability for good (root of a user namespace, or basic mode as root).

    Where the process lacks ``CAP_SETPCAP`` (an ordinary user, basic mode) it has nothing to drop.
    """
    _libc.prctl(PR_SET_SECUREBITS, SECURE_BITS, 0, 0, 0)
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    try:
        with open("/proc/sys/kernel/cap_last_cap") as handle:
            last = int(handle.read())
    except (OSError, ValueError):
        last = 63
    for cap in range(last + 1):
        _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    _check(_libc.capset(ctypes.byref(_CapHeader(CAPABILITY_VERSION_3, 0)), (_CapData * 2)()), "capset")


def _block_sockets() -> None:
    """``basic`` mode without a network namespace: refuse new sockets. Not isolation: ``_socket`` and
    ``ctypes`` reach the real calls; it only stops programs that use the ``socket`` module."""
    import socket

    def refuse(*args: object, **kwargs: object) -> None:
        raise PermissionError("network access is disabled in the moectl sandbox")

    socket.socket.__init__ = refuse  # type: ignore[method-assign]
    socket.socketpair = refuse  # type: ignore[assignment]
    socket.fromfd = refuse  # type: ignore[assignment]


# -- plain values: what crosses between the program's process and the harness ---------------------

MAX_DEPTH = 64  # nesting of one plain value
MESSAGE_LIMIT = 16 * 1024**2  # bytes of one message from the program's process
_CONTAINERS = {list: "list", tuple: "tuple", set: "set", frozenset: "frozenset"}
_BUILD = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}
_SCALARS = {
    "int": lambda text: int(text, 16),
    "float": float.fromhex,
    "complex": lambda real, imag: complex(float.fromhex(real), float.fromhex(imag)),
    "bytes": bytes.fromhex,
}


def encode(value: object, other, depth: int = 0) -> object:
    """``value`` as JSON data when it is plain (exact builtin types, recursively), else ``other(value)``.

    ``type(x) is ...`` throughout: a subclass is not plain, whatever its methods say.
    """
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        return ["int", hex(value)]
    if kind is float:
        return ["float", value.hex()]
    if kind is complex:
        return ["complex", value.real.hex(), value.imag.hex()]
    if kind is bytes:
        return ["bytes", value.hex()]
    if depth < MAX_DEPTH and kind in _CONTAINERS:
        return [_CONTAINERS[kind], [encode(item, other, depth + 1) for item in value]]
    if depth < MAX_DEPTH and kind is dict:
        return [
            "dict",
            [[encode(k, other, depth + 1), encode(v, other, depth + 1)] for k, v in value.items()],
        ]
    return other(value)


def decode(data: object, refer, depth: int = 0) -> object:
    """The value :func:`encode` wrote; ``["ref", ...]`` is ``refer(...)``. Malformed: ValueError/TypeError."""
    if data is None or type(data) is bool or type(data) is str:
        return data
    if type(data) is not list or len(data) < 2 or depth > MAX_DEPTH:
        raise ValueError("not an encoded value")
    tag, body = data[0], data[1:]
    if tag == "ref":
        return refer(*body)
    if tag in _SCALARS and all(type(part) is str for part in body):
        return _SCALARS[tag](*body)
    if len(body) == 1 and type(body[0]) is list:
        if tag in _BUILD:
            return _BUILD[tag](decode(item, refer, depth + 1) for item in body[0])
        if tag == "dict":
            return dict(_pair(item, refer, depth + 1) for item in body[0])
    raise ValueError(f"not an encoded value: {str(tag)[:40]!r}")


def _pair(item: object, refer, depth: int) -> tuple[object, object]:
    if type(item) is not list or len(item) != 2:
        raise ValueError("not an encoded dict item")
    return decode(item[0], refer, depth), decode(item[1], refer, depth)


# -- messages: 4 bytes of length, then JSON ------------------------------------------------------


class Overtime(Exception):
    """The wall-clock limit passed while the harness waited for the program."""


def send(fd: int, message: object, deadline: float | None = None) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    data = len(data).to_bytes(4, "big") + data
    while data:
        if deadline is not None:
            _ready(fd, deadline, write=True)
        try:
            data = data[os.write(fd, data) :]
        except BlockingIOError:
            continue


def receive(fd: int, deadline: float | None = None) -> object:
    """One message; EOFError when the other end is closed, Overtime past ``deadline``."""
    size = int.from_bytes(_read(fd, 4, deadline), "big")
    if size > MESSAGE_LIMIT:
        raise ValueError(f"a message of {size} bytes (the limit is {MESSAGE_LIMIT})")
    return json.loads(_read(fd, size, deadline))


def _read(fd: int, size: int, deadline: float | None) -> bytes:
    chunks, left = [], size
    while left:
        if deadline is not None:
            _ready(fd, deadline)
        try:
            chunk = os.read(fd, min(left, 1 << 20))
        except BlockingIOError:
            continue
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _ready(fd: int, deadline: float, write: bool = False) -> None:
    left = max(0.0, deadline - time.monotonic())
    if not any(select.select([] if write else [fd], [fd] if write else [], [], left)):
        raise Overtime


# -- the program's process -------------------------------------------------------------------------


def _program(config: dict, to_harness: int, from_harness: int) -> None:
    """Join the cgroup, limits, uid; run ``program.py`` as ``__main__``, say so, answer calls; never returns."""
    try:
        for fd in config["cgroup_fds"]:  # before the uid drop: writing there needs root
            os.write(fd, b"0")
            os.close(fd)
        _limit_and_drop(config)
        if config["block_sockets"]:
            _block_sockets()
        os.environ["HOME"] = os.environ["TMPDIR"] = os.getcwd()
        with open("program.py", encoding="utf-8") as handle:
            source = handle.read()
    except BaseException:  # a setup failure: the whole traceback
        traceback.print_exc()
        _flush_and_exit(1)
    try:
        code = compile(source, "program.py", "exec")
    except (SyntaxError, ValueError) as exc:  # the program's error, as the interpreter prints it
        traceback.print_exception(type(exc), exc, None)
        _tell(to_harness, ["raise", type(exc).__name__, _text(exc)])
        _flush_and_exit(1)
    module = types.ModuleType("__main__")
    module.__file__ = "program.py"
    sys.modules["__main__"] = module
    sys.argv = ["program.py"]
    try:
        exec(code, module.__dict__)
    except BaseException as exc:  # print it as the interpreter would, without this frame
        if isinstance(exc, SystemExit):
            print(
                f"moectl-sandbox: the program exited (SystemExit {exc.code!r}) before its end",
                file=sys.stderr,
            )
        else:
            traceback.print_exception(
                type(exc), exc, exc.__traceback__.tb_next if exc.__traceback__ else None
            )
        _tell(to_harness, ["raise", type(exc).__name__, _text(exc)])
        _flush_and_exit(1)
    _tell(to_harness, ["ready"])
    _serve(module.__dict__, to_harness, from_harness)


def _serve(namespace: dict, to_harness: int, from_harness: int) -> None:
    """Answer ``["call", key, args, kwargs]`` until the harness closes its end; never returns."""
    kept: list = []  # results that are not plain; the harness holds their index only

    def keep(value: object) -> object:
        copy = _plain_copy(value)
        if copy is not None:
            return encode(copy, keep)
        kept.append(value)
        return ["ref", len(kept) - 1, _type_name(value)]

    def find(key: object, *_: object) -> object:
        if type(key) is int:
            return kept[key]
        if type(key) is str and key in namespace:
            return namespace[key]
        raise NameError(f"name {key!r} is not defined")

    while True:
        try:
            _, key, args, kwargs = receive(from_harness)
        except BaseException:  # the harness is done (EOF) or the request is not one
            _flush_and_exit(0)
        try:
            function = find(key)
            result = function(*decode(args, find), **dict(_pair(item, find, 0) for item in kwargs))
            reply = ["ok", encode(result, keep)]
        except BaseException as exc:
            traceback.print_exception(type(exc), exc, exc.__traceback__)
            reply = ["raise", type(exc).__name__, _text(exc)]
        _tell(to_harness, reply)


def _plain_copy(value: object) -> object:
    """A standard container whose comparison with a plain value is its base's, as that base: Counter,
    OrderedDict, defaultdict -> dict; a namedtuple -> tuple (MBPP's references return Counters). The
    program's side may send any plain value anyway; this only keeps honest answers passing."""
    import collections

    if type(value) in (collections.Counter, collections.OrderedDict, collections.defaultdict):
        return dict(value)  # type: ignore[call-overload]
    if isinstance(value, tuple) and isinstance(getattr(type(value), "_fields", None), tuple):
        return tuple(value)
    return None


def _tell(fd: int, message: object) -> None:
    """Flush the program's output, then send ``message`` (the harness may have gone: then exit)."""
    _flush()
    try:
        send(fd, message)
    except OSError:
        _flush_and_exit(1)


def _text(exc: BaseException) -> str:
    try:
        return (repr(exc.code) if isinstance(exc, SystemExit) else str(exc))[:1000]
    except BaseException:
        return "<unprintable>"


def _type_name(value: object) -> str:
    try:
        return str(type(value).__qualname__)[:100]
    except BaseException:
        return "object"


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):  # a closed or replaced stream
            stream.flush()


def _flush_and_exit(code: int) -> None:
    _flush()
    os._exit(code & 0xFF)  # no atexit hooks, no waiting for the program's threads


# -- the harness: runs the checks against the program's process -------------------------------------


class NotPlainError(Exception):
    """The checks used a result that is not a plain value (compared it, tested its truth, ...): a failed check."""


class ProgramError(Exception):
    """The program raised, exited, died or broke the protocol: an error, not a failed assert."""


class Remote:
    """A value that stays in the program's process: one of its functions, or a result that is not plain.

    The checks may call it or pass it back to the program; anything else raises :class:`NotPlainError`.
    """

    __slots__ = ("channel", "key", "label")

    def __init__(self, channel: "Channel", key: object, label: str) -> None:
        self.channel, self.key, self.label = channel, key, label

    def __call__(self, *args: object, **kwargs: object) -> object:
        return self.channel.call(self, args, kwargs)

    def __repr__(self) -> str:
        return f"<the program's {self.label}>"

    __str__ = __repr__

    def __getattr__(self, name: str) -> object:
        raise NotPlainError(f"{self!r} is not a plain value: the checks may not read its attribute {name!r}")


def _refuse(self: Remote, *args: object) -> object:
    raise NotPlainError(
        f"the program returned {self!r}, which is not a plain value (exact int, float, complex, str, bytes, "
        "bool, None, or a list/tuple/set/frozenset/dict of them): it is not compared"
    )


_OPERATORS = (
    "eq ne lt le gt ge hash bool len iter reversed contains getitem index int float complex bytes neg pos abs "
    "invert round trunc floor ceil add radd sub rsub mul rmul truediv rtruediv floordiv rfloordiv mod rmod "
    "divmod rdivmod pow rpow and rand or ror xor rxor lshift rlshift rshift rrshift matmul rmatmul"
)
for _name in _OPERATORS.split():
    setattr(Remote, f"__{_name}__", _refuse)


class Channel:
    """The harness's end of the two pipes to the program's process (``pid``), under one deadline."""

    def __init__(self, to_program: int, from_program: int, pid: int, deadline: float) -> None:
        self.to_program, self.from_program, self.pid, self.deadline = to_program, from_program, pid, deadline
        self.status: int | None = None  # the program process's wait status, once it ended
        for fd in (to_program, from_program):
            os.set_blocking(fd, False)

    def remote(self, key: object, label: object = "result", *_: object) -> Remote:
        return Remote(self, key, f"result of type {str(label)[:100]}")

    def call(self, function: Remote, args: tuple, kwargs: dict) -> object:
        """``function(*args, **kwargs)`` in the program's process; its plain result, or a Remote."""
        request = [
            "call",
            function.key,
            encode(list(args), _argument),
            [[k, encode(v, _argument)] for k, v in kwargs.items()],
        ]
        try:
            send(self.to_program, request, self.deadline)
        except OSError:
            raise ProgramError(self.ended(f"before the call of {function.label}")) from None
        return self.unpack(self.receive(f"during the call of {function.label}"), f"{function.label}(...)")

    def wait_ready(self) -> None:
        """Until the program has run ``program.py`` to its end."""
        reply = self.receive("before its end")
        if reply != ["ready"]:
            self.unpack(reply, "the program")
            raise ProgramError("the program's process sent a malformed message instead of reporting its end")

    def receive(self, when: str) -> list:
        try:
            reply = receive(self.from_program, self.deadline)
        except (EOFError, OSError):
            raise ProgramError(self.ended(when)) from None
        except (ValueError, RecursionError) as exc:  # JSON, or a message over the limit
            raise ProgramError(f"the program's process broke the protocol: {exc}") from None
        if type(reply) is not list or not reply:
            raise ProgramError("the program's process sent a malformed message")
        return reply

    def unpack(self, reply: list, what: str) -> object:
        if reply[0] == "ok" and len(reply) == 2:
            try:
                return decode(reply[1], self.remote)
            except (ValueError, TypeError, OverflowError, RecursionError) as exc:
                raise ProgramError(f"{what} returned a malformed value: {exc}") from None
        if reply[0] == "raise" and len(reply) == 3 and type(reply[1]) is str and type(reply[2]) is str:
            name, message = reply[1][:100], reply[2][:1000]
            if name == "AssertionError":
                raise AssertionError(f"{what} raised AssertionError: {message}")
            if name == "SystemExit":
                raise ProgramError(f"{what} exited (SystemExit {message}) before its end: not a pass")
            raise ProgramError(f"{what} raised {name}: {message}")
        raise ProgramError(f"the program's process sent a malformed reply for {what}")

    def ended(self, when: str) -> str:
        """Why the program's end of the pipes closed: its exit status or signal, when it is known."""
        self.reap(0.5)
        if self.status is None:
            return f"the program's process closed its end of the pipes {when}"
        if os.WIFSIGNALED(self.status):
            number = os.WTERMSIG(self.status)
            name = signal.Signals(number).name if number in signal.valid_signals() else str(number)
            return f"the program's process was killed by signal {number} ({name}) {when}"
        return f"the program's process ended (exit status {os.waitstatus_to_exitcode(self.status)}) {when}: not a pass"

    def reap(self, timeout: float) -> None:
        if self.status is None:
            self.status = _wait(self.pid, timeout)

    def finish(self) -> dict:
        """Kill the program's process if it is still running; how it ended when it ended by itself."""
        self.reap(0.0)
        if self.status is None:
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
            return {}
        if os.WIFSIGNALED(self.status):
            return {"signal": os.WTERMSIG(self.status)}
        return {"exit": os.waitstatus_to_exitcode(self.status)}


def _argument(value: object) -> list:
    """How the checks pass a value that is not plain: only the program's own (a Remote) may go back."""
    if type(value) is Remote:
        return ["ref", value.key]
    raise TypeError(f"the checks pass a {type(value).__name__}, not a plain value, to the program")


def judge(checks: dict, channel: Channel) -> tuple[str, str]:
    """Wait for the program to load, run the checks here against it: (verdict, why)."""
    sources = {"<tests>": checks["tests"], "<context>": checks["context"]}
    try:
        channel.wait_ready()
        if checks["tests"]:
            namespace: dict = {"__name__": "__checks__", "__builtins__": builtins}
            for name in checks["imports"]:
                namespace[name] = importlib.import_module(name)
            exec(compile(checks["context"], "<context>", "exec"), namespace)
            for name in checks["names"]:
                namespace[name] = Remote(channel, name, name)
            exec(compile(checks["tests"], "<tests>", "exec"), namespace)
    except Overtime:
        return "timeout", ""
    except (AssertionError, NotPlainError) as exc:
        return "failed", _describe(exc, sources)
    except BaseException as exc:
        return "error", _describe(exc, sources)
    return "passed", ""


def _describe(exc: BaseException, sources: dict[str, str]) -> str:
    """The exception in one line, with the check's line it came from."""
    text = " ".join("".join(traceback.format_exception_only(type(exc), exc)).split())
    lines = [(f.f_code.co_filename, n) for f, n in traceback.walk_tb(exc.__traceback__)]
    lines = [(name, n) for name, n in lines if name in sources]
    if lines:
        name, number = lines[-1]
        source = sources[name].splitlines()
        if 0 < number <= len(source):
            text += f" (at {name} line {number}: {source[number - 1].strip()})"
    return text


def _descendants(root: int) -> list[int]:
    """Processes below ``root`` (this subreaper), from ``/proc``."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as handle:
                    parent[int(entry)] = int(handle.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [root]
    while frontier:
        children = [pid for pid, ppid in parent.items() if ppid in frontier]
        found += children
        frontier = children
    return found


def _kill_descendants() -> None:
    """``basic`` mode: SIGKILL everything below this process (orphans re-parent here) until none is left."""
    for _ in range(200):
        pids = _descendants(os.getpid())
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        time.sleep(0.001)


def _wait(pid: int, timeout: float) -> int | None:
    """The wait status of ``pid``, or ``None`` at ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return None
        if done:
            return status
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.002)


def _read_checks() -> dict:
    """The checks the evaluator wrote to stdin (read only now: the program's process was forked before)."""
    data = b""
    while chunk := os.read(0, 1 << 16):
        data += chunk
    checks = json.loads(data or b"{}")
    return {
        "tests": checks.get("tests", ""),
        "context": checks.get("context", ""),
        "names": checks.get("names", []),
        "imports": checks.get("imports", []),
    }


def main() -> None:
    config = json.loads(sys.argv[1])
    status_fd = config["status_fd"]
    os.set_inheritable(status_fd, False)
    if config["mode"] == "namespace":
        _build_root(config)
    else:
        _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # the checks in its memory: unreadable via /proc or ptrace
    to_program, from_program = os.pipe(), os.pipe()
    deadline = time.monotonic() + config["timeout"]
    pid = os.fork()
    if pid == 0:
        null = os.open("/dev/null", os.O_RDWR)
        os.dup2(null, 0)  # the checks, still unread on stdin, never reach the program
        os.close(null)
        for fd in (status_fd, to_program[1], from_program[0]):
            os.close(fd)
        _program(config, from_program[1], to_program[0])
    for fd in (to_program[0], from_program[1], *config["cgroup_fds"]):
        os.close(fd)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # PID 1 ignores it then; no KeyboardInterrupt here
    channel = Channel(to_program[1], from_program[0], pid, deadline)
    try:
        verdict, detail = judge(_read_checks(), channel)
    except BaseException as exc:  # unreadable checks: the evaluator's bug, reported as an error
        verdict, detail = "error", f"the sandbox could not read the checks: {exc!r}"
    report = {"verdict": verdict, "detail": detail, **channel.finish()}
    if config["mode"] != "namespace":
        _kill_descendants()
    os.write(status_fd, json.dumps(report).encode())
    os._exit(0)  # in namespace mode: PID 1 leaves, and the kernel kills everything still in the namespace


if __name__ == "__main__":
    main()
