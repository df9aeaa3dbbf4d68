"""Stop a long run cleanly: Ctrl-C or SIGTERM sets a flag the training loop reads between steps.

The loop then checkpoints the last finished step and raises ``TrainingInterrupted`` naming how to
resume; a second Ctrl-C stops at once. Used by ``moectl pretrain`` and ``moectl options train``.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class StopRequest:
    """Set by a signal handler; the loop checks it between steps."""

    requested: bool = False


class TrainingInterrupted(Exception):
    """Raised after a stop request (Ctrl-C, SIGTERM) once the last finished step is checkpointed."""

    def __init__(self, out: Path, step: int, resume: str | None = None) -> None:
        resume = resume or f"moectl pretrain --resume {out}"
        super().__init__(f"stopped after step {step}; checkpoint saved. Resume with: {resume}")
        self.out, self.step = out, step


@contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """Handle SIGINT and SIGTERM (main thread only; elsewhere the flag never sets) for the block."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def request_stop(signum, frame) -> None:
        stop.requested = True
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C stops at once

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
