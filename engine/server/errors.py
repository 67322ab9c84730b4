"""OpenAI-style error bodies for every failure, on the API and the control socket alike.

`install_error_handlers` makes each error leave as `{"error": {message, type, param, code}}`:
what a client sent wrong is a 4xx naming the parameter; nothing a client sends causes a 5xx.
"""

from __future__ import annotations

import json
import traceback
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from engine.runtime.log import log
from engine.server.protocol import APIError


def error_response(status: int, body: dict, headers: dict | None = None) -> Response:
    """JSON with non-ASCII escaped: an error that quotes a client's bytes can always be encoded."""
    return Response(json.dumps(body), status_code=status, media_type="application/json", headers=headers)


def closing_response(err: APIError) -> bytes:
    """The whole HTTP/1.1 answer for `err`, ending the connection: what the connection's own
    protocol (app.py) writes when there is no request to hand the app (refused at connect, timed out)."""
    body = json.dumps(err.body()).encode()
    headers = {"content-type": "application/json", "connection": "close",
               **{name.lower(): value for name, value in err.headers.items()}, "content-length": str(len(body))}  # fmt: skip
    head = f"HTTP/1.1 {err.status} {HTTPStatus(err.status).phrase}\r\n" + "".join(
        f"{name}: {value}\r\n" for name, value in headers.items()
    )
    return (head + "\r\n").encode("latin-1") + body


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI-style body; nothing a client sends can cause a 5xx."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return error_response(exc.status, exc.body(), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        err = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path")]
        param = ".".join(loc) or None
        msg = f"{param}: {err.get('msg', 'invalid request')}" if param else err.get("msg", "invalid request")
        return error_response(400, APIError(400, msg, param=param, code="invalid_value").body())

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request_error")
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        body = APIError(exc.status_code, msg, type=kind, code=kind).body()
        return error_response(exc.status_code, body, getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> Response:
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        log(f"{request.method} {request.url.path} failed:\n{''.join(traceback.format_exception(exc))}")
        body = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").body()
        return error_response(500, body)
