"""A deadline for a client to send its request: connections that send nothing are not held forever.

uvicorn closes an idle keep-alive connection ``timeout_keep_alive`` seconds after a response, but
starts no clock before the first request, nor when a client sends part of the next one: 1,100
connections that sent half a header each were held open indefinitely. :func:`protocol_class` wraps
the HTTP protocol uvicorn would pick (httptools where installed, else h11) so that a client has
``read_timeout`` seconds, from connecting or from its previous response, to send a whole request —
headers and body. A request being answered (a long generation, a stream) is never cut: the clock
only closes a connection that is waiting on its client.
"""

from __future__ import annotations

import asyncio
from typing import Any


class ReadDeadline:
    """Mixed in before a uvicorn HTTP protocol class (``H11Protocol`` or ``HttpToolsProtocol``)."""

    read_timeout: float = 30.0
    _read_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm(self) -> None:
        self._disarm()
        loop = self.loop  # type: ignore[attr-defined]
        self._read_deadline = loop.call_later(self.read_timeout, self._read_expired)

    def _disarm(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def waiting_on_client(self) -> bool:
        """No request yet, only part of the next one, or a body still arriving."""
        cycle = getattr(self, "cycle", None)
        return cycle is None or cycle.response_complete or cycle.more_body

    def _read_expired(self) -> None:
        self._read_deadline = None
        transport = self.transport  # type: ignore[attr-defined]
        if self.waiting_on_client() and not transport.is_closing():
            transport.close()


def protocol_class(read_timeout: float) -> type:
    """The HTTP protocol uvicorn's ``http="auto"`` would use, with :class:`ReadDeadline` mixed in."""
    try:
        import httptools  # noqa: F401
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    return type(f"Deadline{base.__name__}", (ReadDeadline, base), {"read_timeout": float(read_timeout)})
