"""Reading a request body: JSON only, bounded in size and in time, strict UTF-8 and JSON."""

from __future__ import annotations

import asyncio
import json

from fastapi import Request

from rooflm.server import protocol as p


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def read_json_body(request: Request, max_bytes: int) -> dict:
    """The body as a JSON object, or a RequestError (400, 413, 415) saying what is wrong."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise p.RequestError("Content-Type must be application/json", status=415)
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > max_bytes):
        raise _too_large(max_bytes)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise _too_large(max_bytes)
    return _parse_json_object(bytes(body))


def _parse_json_object(body: bytes) -> dict:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise p.RequestError(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        # NaN and Infinity are not JSON, though Python's parser takes them by default.
        value = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise p.RequestError("the request body is nested too deeply") from None
    except ValueError as exc:
        raise p.RequestError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise p.RequestError(f"the request body must be a JSON object, got {type(value).__name__}")
    return value


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
