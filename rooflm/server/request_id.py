"""X-Request-Id: every response carries one, the client's when it sent one, a new one otherwise.

The id ties a client's trace to the server's logs: handlers read it with
request_id(raw) and build their engine request ids from it (engine_base_id), so
the engine's own log lines name it too. Prometheus series carry no per-request
labels (one series per request would be unbounded), so in metrics the id
appears nowhere; the histograms are fed from the same engine requests.

The middleware is pure ASGI and outermost: errors written by other middleware
(401, 431), CORS preflights and streams all get the header.
"""

from __future__ import annotations

import re
import uuid

from fastapi import Request

from rooflm.server import protocol as p
from rooflm.server.errors import error_response

HEADER = "X-Request-Id"
_HEADER_KEY = b"x-request-id"
_SCOPE_KEY = "rooflm.request_id"
MAX_REQUEST_ID_CHARS = 128
# Visible ASCII only: the id goes into log lines and engine request ids verbatim.
_VALID = re.compile(r"[\x21-\x7e]{1,%d}" % MAX_REQUEST_ID_CHARS)


def new_request_id() -> str:
    return uuid.uuid4().hex


class RequestIdMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = _client_request_id(scope)
        request_id = sent if sent is not None else new_request_id()
        scope[_SCOPE_KEY] = request_id
        scope[_SCOPE_KEY + ".sent"] = sent is not None
        header = (_HEADER_KEY, request_id.encode("ascii", "replace"))

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != _HEADER_KEY]
                message = {**message, "headers": headers + [header]}
            await send(message)

        if sent is not None and not _VALID.fullmatch(sent):
            # Answered with a fresh id: the one sent cannot be echoed safely.
            scope[_SCOPE_KEY] = new_request_id()
            header = (_HEADER_KEY, scope[_SCOPE_KEY].encode("ascii"))
            error = p.RequestError(f"the {HEADER} header must be 1 to {MAX_REQUEST_ID_CHARS} "
                                   f"visible ASCII characters", param=HEADER)
            await error_response(error)(scope, receive, send_with_id)
            return
        await self.app(scope, receive, send_with_id)


def _client_request_id(scope):
    for name, value in scope["headers"]:
        if name == _HEADER_KEY:
            return value.decode("latin-1")
    return None


def scope_request_id(scope: dict):
    """The request's id from an ASGI scope, None before RequestIdMiddleware ran."""
    return scope.get(_SCOPE_KEY)


def request_id(raw: Request) -> str:
    """The request's id (set by RequestIdMiddleware; a new one if the app runs without it)."""
    value = raw.scope.get(_SCOPE_KEY)
    if value is None:
        value = raw.scope[_SCOPE_KEY] = new_request_id()
    return value


def engine_base_id(raw: Request) -> str:
    """The stem of this request's engine request ids: the X-Request-Id itself when the
    server made it (a fresh uuid, unique), else the client's id plus a nonce, because a
    client may reuse an id while its first request still runs and the engine's ids must
    be unique. Either way a grep for the X-Request-Id finds the engine's lines."""
    value = request_id(raw)
    if raw.scope.get(_SCOPE_KEY + ".sent"):
        return f"{value}-{uuid.uuid4().hex[:8]}"
    return value
