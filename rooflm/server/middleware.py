"""Checks on every request before any route sees it: the API key and the size of the head.

Both are pure ASGI middleware: they never touch the body, so streaming and
disconnect detection pass through them untouched.
"""

from __future__ import annotations

import hmac

from rooflm.server import protocol as p
from rooflm.server.errors import error_response

DOCS_PATH = "/docs"
OPENAPI_PATH = "/openapi.json"
# Paths anyone may GET without the API key: probes and scrapers carry no secrets, and the
# docs page's browser fetch of the schema sends no Authorization header.
PUBLIC_PATHS = ("/health", "/ready", "/metrics", DOCS_PATH, OPENAPI_PATH)


class APIKeyMiddleware:
    """Every path but the probes needs `Authorization: Bearer <key>`."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._key = api_key.encode("utf-8")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self._needs_key(scope) and not self._authorized(scope):
            error = p.RequestError("Incorrect API key provided; send Authorization: Bearer <key>",
                                   status=401, code="invalid_api_key",
                                   headers={"WWW-Authenticate": "Bearer"})
            await error_response(error)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    @staticmethod
    def _needs_key(scope) -> bool:
        # CORS preflights carry no credentials by design.
        return scope["method"] != "OPTIONS" and scope["path"] not in PUBLIC_PATHS

    def _authorized(self, scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                # compare_digest: the time taken does not tell how much of the key matched.
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
        return False


class HeaderLimitMiddleware:
    """Request heads larger than max_header_bytes get 431.

    uvicorn's h11 limit (h11_max_incomplete_event_size) only bounds a head that
    is still arriving; one that arrives whole in a single read passes it. This
    check bounds every head, and answers in OpenAI's error shape.
    """

    def __init__(self, app, max_header_bytes: int):
        self.app = app
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self._head_size(scope) > self.max_header_bytes:
            error = p.RequestError(f"the request's headers are larger than the server's limit "
                                   f"of {self.max_header_bytes} bytes", status=431,
                                   code="headers_too_large")
            await error_response(error)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    @staticmethod
    def _head_size(scope) -> int:
        size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
        return size + sum(len(name) + len(value) + 4 for name, value in scope["headers"])
