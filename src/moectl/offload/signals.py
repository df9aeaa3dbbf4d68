"""Leave on SIGTERM / SIGHUP / SIGINT through the normal unwinding, so ``offload()``'s temporary store goes.

A temporary expert store (``tiny:``, ``shape:`` and hub models served from a ``disk`` store) is a
full copy of the experts in the temp folder; ``OffloadRuntime.close`` removes it. SIGINT already
unwinds (``KeyboardInterrupt``); SIGTERM and SIGHUP, by default, end the process on the spot and
leave the copy behind. While a runtime that owns such a store is open, :class:`ExitOnSignal`
replaces exactly that default action (a signal whose handler is ``SIG_DFL``, or SIGINT's
``default_int_handler``) with ``SystemExit(128 + signum)`` (SIGINT: ``KeyboardInterrupt``), the
conventional exit status of a process ended by the signal: the ``with`` blocks unwind, ``close``
restores the model and removes the store, and the process leaves with that status.

The exception a handler raises surfaces in whatever the main thread was running, and a C
extension may swallow it: PyTorch, asked for the length of an object mid-read, turns it into a
``TypeError`` ("could not determine the shape ..."), which an expert store then reports as a
failed read. So the handler also records the signal, and ``restore()`` raises the signal's exit
again whatever exception is in flight: a signal received while the runtime was open always ends
the process the signal's way, never as a request that failed.

A signal that is ignored or has its own handler (a server's graceful shutdown) is left alone.
While ``hold`` is set (the store is being removed) a signal is deferred to ``restore()``, so the
cleanup finishes. Handlers can only be set from the main thread; elsewhere nothing changes. The
previous handlers are restored when the runtime closes.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


def signal_exit(signum: int) -> BaseException:
    """The exception a signal unwinds with: ``KeyboardInterrupt`` for SIGINT, else ``SystemExit(128 + signum)``."""
    return KeyboardInterrupt() if signum == signal.SIGINT else SystemExit(128 + signum)


class ExitOnSignal:
    """``install()`` while a temporary store exists, ``restore()`` once it is gone."""

    def __init__(self) -> None:
        self._previous: dict[int, object] = {}
        self.received: int | None = None  # the first signal handled while installed
        self.hold = False  # set while cleaning up: the exit waits until cleanup is done

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
        if self.hold:  # deferred to restore()
            return
        raise signal_exit(signum)

    def install(self) -> None:
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        for sig in SIGNALS:
            if signal.getsignal(sig) is signal.SIG_DFL:
                self._previous[sig] = signal.signal(sig, self._handler)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._handler)

    def restore(self) -> None:
        """Put the previous handlers back; a signal received while installed now ends the process."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        self.hold = False
        if self.received is not None:
            signum, self.received = self.received, None
            raise signal_exit(signum)
