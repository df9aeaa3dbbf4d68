"""The first Python code a sandboxed program's process runs (``python -I -c <this file> <config>``).

moectl.eval.code_exec starts this file's source as the child's entry point (never ``preexec_fn``,
which is unsafe in a threaded evaluator) and it, not the evaluator, sets the child up:

1. reads the run's nonce from stdin (then stdin becomes ``/dev/null``); the nonce is written to
   stdout only after the program has run to its end, so ``sys.exit(0)``, ``exit()``, ``quit()``,
   ``os._exit(0)`` or an ``atexit`` hook before the tests cannot count as passing;
2. in ``namespace`` mode (started under ``unshare --pid --fork --kill-child --net --mount ...``, so this
   process is PID 1 of a new PID namespace, with no network but a down loopback) builds a new root:
   a small tmpfs holding read-only binds of the system and Python directories, a private ``/proc``,
   a minimal ``/dev`` and one size-capped tmpfs for the program's files (``/sandbox``, also ``/tmp``),
   then ``pivot_root``s into it so nothing of the evaluator's filesystem stays reachable;
3. forks the program's process, which applies the resource limits (address space, CPU seconds,
   written-file size, open files, processes, no core files), drops to an unprivileged uid when the
   evaluator is root (so ``RLIMIT_NPROC`` applies, and the evaluator cannot be signalled), sets
   ``no_new_privs`` and executes ``program.py`` as ``__main__``;
4. waits for it up to the wall-clock limit, kills it when it is over, and writes one JSON status
   line (``exit``/``signal``/``timeout``) to the status descriptor, which the program does not hold.
   In ``namespace`` mode this process's exit takes every process of the namespace with it (``setsid``
   does not escape); in ``basic`` mode it is a child subreaper and kills all its descendants.

Standard library only, and no moectl imports: it runs with ``-I`` inside the new root.
The nonce lives in this process's memory, so a program written to search the interpreter for it
(frames, ``gc``) could still forge a pass; it stops programs that exit early, not ones that attack
this harness by name.
"""

import contextlib
import ctypes
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
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


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


def _run_program(config: dict, nonce: bytes, result_fd: int) -> None:
    """In the program's process: limits, uid, then ``program.py`` as ``__main__``; never returns."""
    try:
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
        _flush_and_exit(1)
    module = types.ModuleType("__main__")
    module.__file__ = "program.py"
    sys.modules["__main__"] = module
    sys.argv = ["program.py"]
    try:
        exec(code, module.__dict__)
    except SystemExit as exc:
        print(f"moectl-sandbox: the program exited (SystemExit {exc.code!r}) before its end", file=sys.stderr)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
        _flush_and_exit(0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1)
    except BaseException as exc:  # print it as the interpreter would, without this frame
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next if exc.__traceback__ else None)
        _flush_and_exit(1)
    _flush_and_exit(0, lambda: os.write(result_fd, nonce))


def _flush_and_exit(code: int, then: object = None) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):  # a closed or replaced stream
            stream.flush()
    if callable(then):
        try:
            then()
        except OSError:
            code = 1
    os._exit(code & 0xFF)  # no atexit hooks, no waiting for the program's threads


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
    """The wait status of ``pid``, or ``None`` at ``timeout`` seconds (a pidfd when the kernel has them)."""
    deadline = time.monotonic() + timeout
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        if pidfd is None:
            time.sleep(min(left, 0.005))
        else:
            select.select([pidfd], [], [], left)


def main() -> None:
    config = json.loads(sys.argv[1])
    nonce = b""
    while chunk := os.read(0, 4096):
        nonce += chunk
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    result_fd = os.dup(1)  # the nonce's way out; the program's own stdout is discarded
    os.dup2(null, 1)
    status_fd = config["status_fd"]
    os.set_inheritable(status_fd, False)
    if config["mode"] == "namespace":
        _build_root(config)
    else:
        _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # its memory (and so the nonce) unreadable via /proc or ptrace
    pid = os.fork()
    if pid == 0:
        os.close(status_fd)
        _run_program(config, nonce, result_fd)
    nonce = b""
    os.close(result_fd)
    status = _wait(pid, config["timeout"])
    if status is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        report = {"timeout": True}
    elif os.WIFSIGNALED(status):
        report = {"signal": os.WTERMSIG(status)}
    else:
        report = {"exit": os.waitstatus_to_exitcode(status)}
    if config["mode"] != "namespace":
        _kill_descendants()
    os.write(status_fd, json.dumps(report).encode())
    os._exit(0)  # in namespace mode: PID 1 leaves, and the kernel kills everything still in the namespace


if __name__ == "__main__":
    main()
