"""One log line per request when its response ends: method, path, status, latency and tokens.

vLLM's habit (uvicorn's access log plus its request logger) in one line, e.g.

  INFO rooflm.server.access: 127.0.0.1:51234 "POST /v1/completions" 200 412.7 ms
       prompt_tokens=5 completion_tokens=16 request_id=9f1c...

The latency runs from the request's arrival to the end of its response, the whole stream for
SSE. Tokens are counted for requests that reached the engine (the handlers note their
Generation with note_generation); other requests print "-". `rooflm serve
--disable-log-requests` leaves this middleware out.

A pure ASGI middleware: it wraps `send` to read the status and never touches the body, so
streaming and disconnect detection pass through untouched. A client that leaves before any
answer is logged with status 499 (nginx's "client closed request").
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from rooflm.server.request_id import scope_request_id

logger = logging.getLogger("rooflm.server.access")

_SCOPE_KEY = "rooflm.access"
CLIENT_CLOSED = 499


class AccessRecord:
    """What the line needs beyond the ASGI messages: the request's Generation, if any."""

    __slots__ = ("status", "generation")

    def __init__(self):
        self.status: Optional[int] = None
        self.generation = None  # server.generation.Generation

    def token_counts(self) -> tuple[Optional[int], Optional[int]]:
        if self.generation is None:
            return None, None
        usage = self.generation.usage()
        return usage.prompt_tokens, usage.completion_tokens


def note_generation(scope: dict, generation) -> None:
    """Attach a request's Generation so that its line carries its token counts."""
    record = scope.get(_SCOPE_KEY)
    if record is not None:
        record.generation = generation


class AccessLogMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        record = scope[_SCOPE_KEY] = AccessRecord()

        async def send_and_note(message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            logger.info(format_line(scope, record, time.perf_counter() - start))


def format_line(scope: dict, record: AccessRecord, elapsed_s: float) -> str:
    client = scope.get("client")
    where = f"{client[0]}:{client[1]}" if client else "-"
    path = scope.get("path", "")[:200]
    status = record.status if record.status is not None else CLIENT_CLOSED
    prompt, completion = record.token_counts()
    tokens = "-" if prompt is None else prompt
    done = "-" if completion is None else completion
    return (f'{where} "{scope.get("method", "?")} {path}" {status} {elapsed_s * 1e3:.1f} ms '
            f"prompt_tokens={tokens} completion_tokens={done} "
            f"request_id={scope_request_id(scope) or '-'}")
