"""Slow clients: a request head or body that does not arrive in time, and how many may be arriving.

uvicorn bounds neither: its keep-alive timeout runs only between requests and
is cancelled by every byte that arrives, so a client that sends `Content-Length:
1000`, 10 bytes and then nothing holds its connection (and a handler) forever,
and a few hundred such clients are a slowloris attack. nginx answers 408 after
60 s (client_header_timeout, client_body_timeout); so do we:

  head  HeadTimeoutProtocol, uvicorn's h11 protocol with a timer from a new
        request's first byte (or the connection's opening) until its head is
        parsed; past header_timeout_s the client gets a bare 408 and the
        connection is closed. The app never sees such a request.
  body  BodyTimeoutMiddleware times the app's receive() calls from the moment
        the head was parsed; a body incomplete after body_timeout_s gets 408
        (OpenAI's error shape, Connection: close).

Each counts what is still arriving in a ReadingGate of its own: heads not yet
parsed, and bodies that did not come whole in their first piece. At
max_reading_connections heads, a new connection gets 503 and is closed; at as
many bodies, a request whose body is still coming gets 503 and is closed. A request whose body is already complete when the app first
reads it is never refused, and admitted requests (generating, streaming) are
not counted at all: the gate sheds slow readers, never the work they crowd.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from rooflm.server import protocol as p
from rooflm.server.errors import error_response, server_error


@dataclass
class ReadingGate:
    """How many heads and bodies are still arriving, and how many may be."""

    limit: int
    reading: int = field(default=0)

    def try_enter(self) -> bool:
        if self.reading >= self.limit:
            return False
        self.reading += 1
        return True

    def leave(self) -> None:
        self.reading -= 1


class _BodyTimedOut(Exception):
    pass


class _TooManyReaders(Exception):
    pass


class _TimedReceive:
    """The app's receive(), bounded in time until the body is complete.

    After the body, receive() only waits for the client to disconnect (a stream's
    disconnect detection), which must never time out: it passes straight through.
    """

    def __init__(self, receive, timeout_s: float, gate: ReadingGate):
        self._receive = receive
        self._deadline = time.monotonic() + timeout_s
        self._gate = gate
        self._complete = False
        self._counted = False

    async def __call__(self):
        if self._complete:
            return await self._receive()
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise _BodyTimedOut()
        try:
            message = await asyncio.wait_for(self._receive(), remaining)
        except asyncio.TimeoutError:
            raise _BodyTimedOut() from None
        if message["type"] == "http.request" and message.get("more_body", False):
            if not self._counted:
                if not self._gate.try_enter():
                    raise _TooManyReaders()
                self._counted = True
        else:
            self._finish()
        return message

    def _finish(self) -> None:
        self._complete = True
        if self._counted:
            self._counted = False
            self._gate.leave()


class BodyTimeoutMiddleware:
    """408 for a body that does not arrive within timeout_s; 503 past the gate's limit."""

    def __init__(self, app, timeout_s: float, gate: ReadingGate):
        self.app = app
        self.timeout_s = timeout_s
        self.gate = gate

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.timeout_s <= 0:
            await self.app(scope, receive, send)
            return
        timed = _TimedReceive(receive, self.timeout_s, self.gate)
        started = False

        async def tracked_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, timed, tracked_send)
        except _BodyTimedOut:
            if not started:
                await _close_with(p.RequestError(
                    f"the request body did not arrive within {self.timeout_s:g} s "
                    f"(--body-timeout-s)", status=408, code="body_timeout",
                    headers={"Connection": "close"}), scope, receive, send)
        except _TooManyReaders:
            if not started:
                await _close_with(server_error(
                    f"too many requests are still sending their bodies (the limit is "
                    f"{self.gate.limit}, --max-reading-connections); retry", 503,
                    "too_many_slow_requests"), scope, receive, send, retry_after="1")
        finally:
            timed._finish()


async def _close_with(error: p.RequestError, scope, receive, send, retry_after=None) -> None:
    error.headers = {**error.headers, "Connection": "close"}
    if retry_after is not None:
        error.headers["Retry-After"] = retry_after
    await error_response(error)(scope, receive, send)


def _bare_response(status: str, text: str, extra: str = "") -> bytes:
    body = text.encode("ascii")
    return (f"HTTP/1.1 {status}\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
            f"{extra}content-length: {len(body)}\r\n\r\n").encode("ascii") + body


_BARE_408 = _bare_response("408 Request Timeout",
                           "the request head did not arrive in time (--header-timeout-s)")
_BARE_503 = _bare_response("503 Service Unavailable",
                           "too many connections are still sending their requests; retry",
                           "retry-after: 1\r\n")


def head_timeout_protocol(timeout_s: float, gate: ReadingGate):
    """uvicorn's h11 protocol class with a deadline on each request head (module docstring).

    A class per server: uvicorn builds one instance per connection from the class alone."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadTimeoutProtocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_timer = None
            self._head_cycle = None
            self._arm_head_timer()

        def data_received(self, data: bytes) -> None:
            if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm_head_timer()  # the first byte of the next request on this connection
                if self.transport.is_closing():
                    return
            super().data_received(data)
            if self.cycle is not None and self.cycle is not self._head_cycle:
                self._head_cycle = self.cycle  # a head was parsed: the app has the request
                self._disarm_head_timer()

        def connection_lost(self, exc) -> None:
            self._disarm_head_timer()
            super().connection_lost(exc)

        def _arm_head_timer(self) -> None:
            if timeout_s <= 0:
                return
            if not gate.try_enter():
                self._answer_and_close(_BARE_503)
                return
            self._head_timer = self.loop.call_later(timeout_s, self._head_timed_out)

        def _disarm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
                gate.leave()

        def _head_timed_out(self) -> None:
            self._head_timer = None
            gate.leave()
            self._answer_and_close(_BARE_408)

        def _answer_and_close(self, response: bytes) -> None:
            if self.transport.is_closing():
                return
            # h11 has no way to answer a request it has not parsed: the bytes go out raw.
            self.transport.write(response)
            try:
                self.conn.send(h11.ConnectionClosed())
            except h11.LocalProtocolError:
                pass
            self.transport.close()

    return HeadTimeoutProtocol
