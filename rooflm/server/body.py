"""Reading a request body: JSON only, bounded in size and in time, strict UTF-8 and JSON.

A body the server refuses (too large, wrong content type) is still read to its
end and thrown away, up to DISCARD_LIMIT_BYTES and DISCARD_TIMEOUT_S: a server
that answers and closes while the client is still sending leaves unread bytes
in its socket, the kernel then resets the connection, and the client sees
"connection reset by peer" instead of the 413 (an ~8 MB body did
this). Past the discard bounds the connection is closed after the answer,
which a client may again see as a reset; a body that large is not a mistake.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

from fastapi import Request

from rooflm.server import protocol as p

# How much of a refused body is read and dropped so that its sender can read the answer.
DISCARD_LIMIT_BYTES = 64 << 20
DISCARD_TIMEOUT_S = 15.0


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        self.key = key


def _object_without_duplicates(pairs: list[tuple[str, object]]) -> dict:
    # Python keeps the last of two equal keys, other parsers the first: a proxy that
    # checked {"max_tokens": 10, "max_tokens": 100000} would have checked another
    # request than ours. JSON leaves it undefined (RFC 8259), so we refuse it.
    value = dict(pairs)
    if len(value) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return value


class _ClientGone(Exception):
    """The client disconnected before its body arrived; nobody will read an answer."""


async def _next_chunk(request: Request) -> tuple[bytes, bool]:
    """The next piece of the body and whether more follows (ASGI http.request messages)."""
    message = await request.receive()
    if message["type"] == "http.disconnect":
        raise _ClientGone()
    return message.get("body", b""), message.get("more_body", False)


async def _discard_rest(request: Request, more: bool, declared: int | None) -> None:
    """Read what is left of a refused body and drop it, within the discard bounds."""
    if declared is not None and declared > DISCARD_LIMIT_BYTES:
        return  # not worth reading: the connection closes after the answer
    discarded = 0
    deadline = time.monotonic() + DISCARD_TIMEOUT_S
    try:
        while more and discarded <= DISCARD_LIMIT_BYTES:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            chunk, more = await asyncio.wait_for(_next_chunk(request), remaining)
            discarded += len(chunk)
    except (_ClientGone, asyncio.TimeoutError):
        return


def _declared_length(request: Request) -> int | None:
    declared = request.headers.get("content-length")
    if declared is None:
        return None
    declared = declared.strip()
    if not declared.isdigit():
        raise p.RequestError("the Content-Length header is not a number")
    return int(declared)


async def read_json_body(request: Request, max_bytes: int) -> dict:
    """The body as a JSON object, or a RequestError (400, 413, 415) saying what is wrong."""
    body = bytearray()
    more = True
    declared = None
    try:
        media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media_type != "application/json":
            raise p.RequestError("Content-Type must be application/json", status=415)
        declared = _declared_length(request)
        if declared is not None and declared > max_bytes:
            raise _too_large(max_bytes)
        while more:
            chunk, more = await _next_chunk(request)
            body += chunk
            if len(body) > max_bytes:
                raise _too_large(max_bytes)
    except p.RequestError:
        await _discard_rest(request, more, declared)
        raise
    except _ClientGone:
        raise p.RequestError("the client disconnected before sending the whole body") from None
    return _parse_json_object(bytes(body))


def _parse_json_object(body: bytes) -> dict:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise p.RequestError(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        # NaN and Infinity are not JSON, though Python's parser takes them by default.
        value = json.loads(text, parse_constant=_reject_constant,
                           object_pairs_hook=_object_without_duplicates)
    except _DuplicateKey as exc:
        raise p.RequestError(f"the request body has the key {p.short_repr(exc.key)} twice in one "
                             f"object", param=exc.key[:64]) from None
    except RecursionError:
        raise p.RequestError("the request body is nested too deeply") from None
    except ValueError as exc:
        raise p.RequestError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise p.RequestError(f"the request body must be a JSON object, got {type(value).__name__}")
    if _SURROGATE_ESCAPE.search(text):
        _refuse_lone_surrogates(value, ())
    return value


# A \uD800-\uDFFF escape: JSON lets one stand alone, and Python's parser makes it a
# lone surrogate, which is not text (no UTF-8 for it): the tokenizer, the engine-core
# messages and the stop matcher would each fail on it in their own way. A valid pair
# parses into one character, so only what is left alone is refused.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")


def _refuse_lone_surrogates(value, path: tuple) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            where = ".".join(str(part) for part in path)
            raise p.RequestError(f"{where or 'the request body'} holds a lone UTF-16 surrogate "
                                 f"escape (\\uD800-\\uDFFF), which is not text",
                                 param=where or None) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _refuse_lone_surrogates(key, path)
            _refuse_lone_surrogates(item, path + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _refuse_lone_surrogates(item, path + (index,))


def _too_large(max_bytes: int) -> p.RequestError:
    return p.RequestError(f"the request body is larger than the server's limit of {max_bytes} bytes",
                          status=413, code="request_too_large")


async def read_body_in_time(request: Request, max_bytes: int, timeout: float) -> dict:
    """A client that sends its body slowly (or never) must not hold a handler forever."""
    if timeout <= 0:
        return await read_json_body(request, max_bytes)
    try:
        return await asyncio.wait_for(read_json_body(request, max_bytes), timeout)
    except asyncio.TimeoutError:
        raise p.RequestError("the request body did not arrive within the request timeout",
                             status=408, code="timeout") from None
