"""OpenAI-shaped errors: every failure a client sees is ``{"error": {"message", "type", "param", "code"}}``.

The ``openai`` client turns these into its own exceptions (``BadRequestError``,
``AuthenticationError``, ``NotFoundError``, ``RateLimitError``) with the message intact, so a
user of any OpenAI client reads what was wrong and what is allowed. FastAPI's own failures
(malformed JSON, a field of the wrong type, an unknown path) are reshaped the same way; nothing
unexpected reaches a client as a traceback (it is logged, and the client gets a 500).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("moectl.server")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """A request the server refuses: HTTP ``status`` with an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, ERROR_TYPES.get(self.status, "invalid_request_error"), self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The body of an OpenAI error response."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def validation_error(err: RequestValidationError) -> APIError:
    """FastAPI's validation failure as one 400 naming the field: malformed JSON, a missing field or
    one of the wrong type (the first problem; a client fixes one at a time)."""
    first = err.errors()[0] if err.errors() else {"msg": "invalid request", "loc": ()}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    if not loc and first.get("type") in ("model_attributes_type", "dict_type"):
        return APIError(400, "the request body must be a JSON object (Content-Type: application/json)")
    if first.get("type") == "missing":
        return APIError(400, f"missing required field {'.'.join(loc)!r}", param=".".join(loc) or None)
    param = ".".join(loc) or None
    where = f"{param}: " if param else "the request body: "
    return APIError(400, f"{where}{first['msg']}", param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Route every error a request can raise to an OpenAI-shaped response."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError) -> JSONResponse:
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        return validation_error(err).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException) -> JSONResponse:
        message = (
            f"no route {request.method} {request.url.path}; this server has "
            f"{', '.join(getattr(request.app.state, 'endpoints', []))}"
            if err.status_code in (404, 405)
            else str(err.detail)
        )
        return APIError(err.status_code, message, headers=dict(err.headers or {})).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, err: Exception) -> JSONResponse:
        log.exception("request failed")
        return APIError(500, f"internal error: {type(err).__name__}: {err}").response()


def endpoints(routers: Any) -> list[str]:
    """``METHOD /path`` of every endpoint of ``routers`` (what a 404 lists); an entry without a path
    and methods (an included router, as FastAPI keeps it) is left to its own router's listing."""
    found = {(route.path, method) for router in routers for route in router.routes
             for method in getattr(route, "methods", ()) if method != "HEAD"}  # fmt: skip
    return [f"{method} {path}" for path, method in sorted(found)]
