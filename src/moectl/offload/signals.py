"""Leave on SIGTERM / SIGHUP through the normal unwinding, so ``offload()``'s temporary store goes.

A temporary expert store (``tiny:``, ``shape:`` and hub models served from a ``disk`` store) is a
full copy of the experts in the temp folder; ``OffloadRuntime.close`` removes it. SIGINT already
unwinds (``KeyboardInterrupt``); SIGTERM and SIGHUP, by default, end the process on the spot and
leave the copy behind. While a runtime that owns such a store is open, :class:`ExitOnSignal`
replaces exactly that default action (a signal whose handler is ``SIG_DFL``) with
``SystemExit(128 + signum)``, the conventional exit status of a process ended by the signal: the
``with`` blocks unwind, ``close`` restores the model and removes the store, and the process
leaves with that status. A signal that is ignored or has its own handler (a server's graceful
shutdown) is left alone. Handlers can only be set from the main thread; elsewhere nothing
changes. The previous handlers are restored when the runtime closes.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


class ExitOnSignal:
    """``install()`` while a temporary store exists, ``restore()`` once it is gone."""

    def __init__(self) -> None:
        self._previous: dict[int, object] = {}
        self.deferred: int | None = None  # a signal that arrived while ``hold`` was set
        self.hold = False  # set while cleaning up: the exit waits until cleanup is done

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.hold:
            self.deferred = signum
            return
        raise SystemExit(128 + signum)

    def install(self) -> None:
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        for sig in SIGNALS:
            if signal.getsignal(sig) is signal.SIG_DFL:
                self._previous[sig] = signal.signal(sig, self._handler)

    def restore(self) -> None:
        """Put the previous handlers back; a signal deferred by ``hold`` now exits."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        self.hold = False
        if self.deferred is not None:
            signum, self.deferred = self.deferred, None
            raise SystemExit(128 + signum)
