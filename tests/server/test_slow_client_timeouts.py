"""Slow clients on a real `rooflm serve` (127.0.0.1, raw sockets): heads and bodies that stop.

The server runs with short timeouts and a small limit on what may be still
arriving (server/slow_clients.py): a body that stops gets 408 and its connection
closed, as does a head that stops; past the limit a slow body gets 503 at once,
while a normal request and an admitted stream are served as ever.
"""

import asyncio
import json
import socket
import time

import httpx
import pytest

from tests.server.server_utils import MODEL, SMALL_ENGINE_ARGS, scrape, start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BODY_TIMEOUT_S = 10
HEAD_TIMEOUT_S = 10
LIMIT = 6
# Generous bounds for waiting on the server: a loaded 2-core machine is slow, never stuck.
ANSWER_WAIT_S = 90


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("slow-clients")
    process = start_server(tmp, "slow", SMALL_ENGINE_ARGS + [
        "--body-timeout-s", str(BODY_TIMEOUT_S), "--header-timeout-s", str(HEAD_TIMEOUT_S),
        "--max-reading-connections", str(LIMIT)])
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


def _connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=ANSWER_WAIT_S)
    return sock


def _slow_body(server, declared: int = 1000, sent: bytes = b'{"model": ') -> socket.socket:
    """A completion request whose head says `declared` bytes of body, and only `sent` follow."""
    sock = _connect(server)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {declared}\r\n\r\n").encode("ascii")
    sock.sendall(head + sent)
    return sock


def _read_answer(sock: socket.socket) -> tuple[int, bytes]:
    """The status and everything the server sent until it closed the connection."""
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    sock.close()
    assert data.startswith(b"HTTP/1.1 "), data[:200]
    return int(data.split(b" ", 2)[1]), data


def _reading_bodies(server) -> float:
    return scrape(server.url)[("rooflm:reading_bodies", ())]


def _wait_reading_bodies(server, count: int) -> None:
    deadline = time.monotonic() + ANSWER_WAIT_S
    while _reading_bodies(server) != count:
        assert time.monotonic() < deadline, f"never {count} bodies reading"
        time.sleep(0.05)


def test_a_body_that_stops_gets_408_and_its_connection_closed(server):
    sock = _slow_body(server, 1000, b"0123456789")
    # _read_answer returns only once the server closed the connection: no keep-alive.
    status, data = _read_answer(sock)
    assert status == 408
    body = json.loads(data.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "body_timeout"
    assert b"connection: close" in data.lower()
    _wait_reading_bodies(server, 0)


def test_a_head_that_stops_gets_408(server):
    sock = _connect(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
    status, data = _read_answer(sock)
    assert status == 408
    assert b"head did not arrive" in data
    # A connection that never sends a byte is closed too (a 408 nobody asked for).
    status, _ = _read_answer(_connect(server))
    assert status == 408


def test_slow_bodies_do_not_hold_up_a_normal_request(server):
    slow = [_slow_body(server) for _ in range(LIMIT - 2)]
    _wait_reading_bodies(server, LIMIT - 2)
    response = httpx.post(server.url + "/v1/completions", timeout=ANSWER_WAIT_S, json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 2, "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2
    assert [_read_answer(sock)[0] for sock in slow] == [408] * len(slow)


async def _stream_tokens(server, started: asyncio.Event) -> list:
    body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 48, "ignore_eos": True,
            "stream": True}
    events = []
    async with httpx.AsyncClient(base_url=server.url, timeout=ANSWER_WAIT_S) as client:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[len("data: "):]))
                    started.set()
    return events


async def _fill_the_gate_while_streaming(server):
    started = asyncio.Event()
    stream = asyncio.create_task(_stream_tokens(server, started))
    await asyncio.wait_for(started.wait(), ANSWER_WAIT_S)
    slow = [_slow_body(server) for _ in range(LIMIT)]
    await asyncio.to_thread(_wait_reading_bodies, server, LIMIT)
    refused = _slow_body(server)
    status, data = await asyncio.to_thread(_read_answer, refused)
    async with httpx.AsyncClient(base_url=server.url, timeout=ANSWER_WAIT_S) as client:
        normal = await client.post("/v1/completions", json={
            "model": MODEL, "prompt": "Hi", "max_tokens": 2, "ignore_eos": True})
    events = await stream
    timed_out = [await asyncio.to_thread(_read_answer, sock) for sock in slow]
    return status, data, normal, events, [s for s, _ in timed_out]


def test_past_the_limit_a_slow_body_gets_503_and_admitted_work_goes_on(server):
    status, data, normal, events, timed_out = asyncio.run(
        asyncio.wait_for(_fill_the_gate_while_streaming(server), 240))
    assert status == 503
    assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "too_many_slow_requests"
    assert b"retry-after" in data.lower()
    # A body that arrives whole is never counted, so never refused.
    assert normal.status_code == 200, normal.text
    # The stream admitted before the gate filled ran to its end.
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert timed_out == [408] * LIMIT
    _wait_reading_bodies(server, 0)
