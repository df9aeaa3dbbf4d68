"""Run the app under uvicorn until SIGTERM or SIGINT, then leave with exit status 0 within a deadline.

uvicorn handles both signals gracefully: it stops accepting connections, lets in-flight
responses finish, then runs the app's shutdown (the engine drains and its thread joins). A
request may run for minutes, so the wait is bounded (:class:`ServeLimits.shutdown_timeout`): at
the deadline every request still running is finished by the engine with ``finish_reason:
"abort"`` (vLLM's), so each client gets a well-formed last chunk or response, and the process exits
about one engine step later; connections still open :data:`ABORT_GRACE_S` after that are closed.
After shutting down uvicorn re-raises the signal it stopped on, under the handler that was
installed before it ran; with the default handler that would end the process by the signal
(status -15) although the shutdown was clean. :func:`serve` installs a handler that ignores the
re-raised signal, so a clean shutdown exits 0.

Clients that send nothing get :mod:`moectl.server.slow_clients`' read deadline, and idle
keep-alive connections uvicorn's ``timeout_keep_alive``.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import uvicorn

from moectl.errors import ConfigError, UnavailableError
from moectl.server.slow_clients import protocol_class

SIGNALS = (signal.SIGINT, signal.SIGTERM)
ABORT_GRACE_S = 5.0  # after the abort, for the aborted responses' last bytes to go out


@dataclass(frozen=True)
class ServeLimits:
    """How long the server waits on clients and on itself (seconds)."""

    read_timeout: float = 30.0  # to send a whole request, from connecting or from the previous response
    timeout_keep_alive: float = 5.0  # an idle keep-alive connection (uvicorn's and vLLM's flag)
    shutdown_timeout: float = 30.0  # from SIGTERM to aborting the requests still running

    def __post_init__(self) -> None:
        for name in ("read_timeout", "timeout_keep_alive", "shutdown_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 86_400:
                raise ConfigError(f"--{name.replace('_', '-')} must be a number of seconds in (0, 86400), got {value!r}")


def serve(
    app: Any,
    host: str,
    port: int,
    log_level: str = "info",
    limits: ServeLimits | None = None,
    on_deadline: Callable[[], None] | None = None,
) -> None:
    """Serve ``app`` on ``host:port`` until a signal stops it gracefully; ``on_deadline`` is called
    ``limits.shutdown_timeout`` seconds into the shutdown if requests are still running (the
    engine's ``abort``)."""
    limits = limits or ServeLimits()
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        http=protocol_class(limits.read_timeout),
        timeout_keep_alive=limits.timeout_keep_alive,  # type: ignore[arg-type]
        timeout_graceful_shutdown=int(limits.shutdown_timeout + ABORT_GRACE_S + 0.999),
    )
    server = DeadlineServer(config, limits.shutdown_timeout, on_deadline)
    if threading.current_thread() is not threading.main_thread():  # signals belong to the main thread
        server.run()
        return
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in SIGNALS}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        raise UnavailableError(f"the server on {host}:{port} did not start (the log above says why)")


class DeadlineServer(uvicorn.Server):
    """uvicorn's ``Server`` whose shutdown calls ``on_deadline`` once ``deadline`` seconds have passed."""

    def __init__(self, config: uvicorn.Config, deadline: float, on_deadline: Callable[[], None] | None) -> None:
        super().__init__(config)
        self.deadline, self.on_deadline = deadline, on_deadline

    async def shutdown(self, sockets: Any = None) -> None:
        timer = None
        if self.on_deadline is not None:
            timer = asyncio.get_running_loop().call_later(self.deadline, self.on_deadline)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()
