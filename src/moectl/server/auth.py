"""``--api-key``: every request but ``GET /health`` carries ``Authorization: Bearer KEY`` (401 otherwise).

A plain ASGI middleware, not Starlette's ``BaseHTTPMiddleware``: that one wraps the response
stream, which delays a client's disconnect from reaching the streaming handler. The key is
compared in constant time.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from moectl.server.api_errors import APIError

OPEN_PATHS = frozenset({"/health"})


class APIKeyMiddleware:
    """Refuse a request without the right bearer key before it reaches a handler."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            message = (
                "no API key: send the header Authorization: Bearer KEY (the openai client's api_key)"
                if not given
                else "wrong API key: send the key this server was started with (--api-key)"
            )
            await APIError(401, message, code="invalid_api_key").response()(scope, receive, send)
            return
        await self.app(scope, receive, send)
