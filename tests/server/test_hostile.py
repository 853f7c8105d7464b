"""Hostile clients: every case of the corpus (hostile_corpus.py) against one server, raw-socket
bodies past the size limit, and a client that trickles its headers.

Each error answer must have OpenAI's error shape naming the field; each request at
the edge of what is allowed must be served; and the server must keep serving a
normal request correctly throughout (checked every CHECK_EVERY cases and at the end,
when nothing may be left running and every KV block must be free).

Decided and tested here: unknown fields are ignored (as vLLM does), so sending
them is not an error; fields OpenAI defines but rooflm does not implement are
refused when set.
"""

import asyncio
import json
import socket
import time

import httpx
import pytest

from tests.server.hostile_corpus import ALL_CASES, Case
from tests.server.server_utils import (API_KEY, MAIN_SERVER_ARGS, MODEL, assert_idle,
                                       assert_openai_error, start_server, wait_until_idle)

# A real server process: the real model, bounded in time even without --timeout.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

JSON = {"Content-Type": "application/json"}
CHECK_EVERY = 40
NORMAL = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0,
          "ignore_eos": True}

# SmolLM2's tokenizer and chat template on a 2-layer, hidden-64 random model: the corpus tests
# the server, not the model, and a hundred generations of it take seconds instead of minutes.
TINY_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """One server for the whole corpus: the main server's flags, a tiny random model."""
    from rooflm.tokenizer.dummy_model_dir import make_dummy_model_dir

    tmp = tmp_path_factory.mktemp("hostile")
    model_dir = tmp / "tiny-smollm2"
    make_dummy_model_dir("smollm2-135m", str(model_dir))
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, **TINY_SHAPE}))
    process = start_server(tmp, "tiny", MAIN_SERVER_ARGS + [
        "--model", str(model_dir), "--load-format", "dummy", "--served-model-name", MODEL])
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


def send(client: httpx.Client, case: Case) -> httpx.Response:
    headers = case.headers
    if headers is None:
        headers = {**JSON, "Authorization": f"Bearer {API_KEY}"}
    content = case.raw
    if content is None and case.body is not None:
        content = json.dumps(case.body).encode()
    return client.request(case.method, case.path, content=content, headers=headers)


def check(case: Case, response: httpx.Response) -> None:
    if case.status != 200:
        error = assert_openai_error(response, case.status)
        if case.param is not None:
            assert (error["param"] or "").startswith(case.param), error
        for fragment in case.contains:
            assert fragment in error["message"], error
        return
    assert response.status_code == 200, response.text[:500]
    if case.stream:
        assert response.text.rstrip().endswith("data: [DONE]"), response.text[-300:]
        assert '"error"' not in response.text, response.text[-300:]
        return
    body = response.json()
    assert body["choices"] and all(c["finish_reason"] in ("length", "stop") for c in body["choices"])


def assert_serves_normally(client: httpx.Client) -> None:
    response = client.post("/v1/completions", json=NORMAL, headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 200, response.text[:300]
    assert response.json()["usage"]["completion_tokens"] == NORMAL["max_tokens"]
    assert client.get("/health").status_code == 200


def test_the_corpus_is_large_and_named_uniquely():
    assert len(ALL_CASES) >= 150
    assert len({case.name for case in ALL_CASES}) == len(ALL_CASES)


def test_hostile_corpus(tiny):
    server = tiny
    failures = []
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for index, case in enumerate(ALL_CASES):
            try:
                check(case, send(client, case))
            except (AssertionError, httpx.HTTPError, ValueError) as exc:
                failures.append(f"{case.name}: {type(exc).__name__}: {str(exc)[:300]}")
            if index % CHECK_EVERY == CHECK_EVERY - 1:
                assert_serves_normally(client)
        assert_serves_normally(client)
    assert not failures, f"{len(failures)} of {len(ALL_CASES)} cases failed:\n" + "\n".join(failures)
    assert_idle(wait_until_idle(server.url))
    assert "Traceback" not in server.log_tail(1 << 20)


# ---- bodies past the limit: the client must read the 413, not a reset -------------------------------


def _raw_exchange(url: str, head: bytes, body_size: int) -> bytes:
    """Send a head and body_size bytes of body on a raw socket; return all that comes back."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head)
        chunk = b" " * 65536
        sent = 0
        while sent < body_size:
            piece = chunk[:body_size - sent]
            sock.sendall(piece)
            sent += len(piece)
        received = b""
        while True:
            data = sock.recv(65536)
            if not data:
                return received
            received += data


@pytest.mark.parametrize("size", [8_000_000, 20_000_000])
def test_an_8mb_body_gets_a_413_the_client_can_read(tiny, size):
    server = tiny
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Length: {size}\r\nConnection: close\r\n\r\n")
    answer = _raw_exchange(server.url, head.encode(), size)
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 413"), answer[:200]
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "request_too_large"
    # The same through an ordinary client, with and without a Content-Length.
    body = b'{"model": "' + MODEL.encode() + b'", "prompt": "' + b"a" * size + b'"}'
    auth = {**JSON, "Authorization": f"Bearer {API_KEY}"}
    assert_openai_error(httpx.post(server.url + "/v1/completions", content=body, headers=auth,
                                   timeout=60), 413)
    pieces = (body[i:i + (1 << 20)] for i in range(0, len(body), 1 << 20))
    assert_openai_error(httpx.post(server.url + "/v1/completions", content=pieces, headers=auth,
                                   timeout=60), 413)


def test_a_wrong_content_type_with_a_big_body_is_readable(tiny):
    server = tiny
    auth = {"Content-Type": "text/plain", "Authorization": f"Bearer {API_KEY}"}
    response = httpx.post(server.url + "/v1/completions", content=b"x" * 20_000_000, headers=auth,
                          timeout=60)
    assert_openai_error(response, 415)


def test_chunked_oversized_body_is_413(tiny, auth):
    server = tiny
    def chunks():
        for _ in range(40):
            yield b" " * 65536  # 2.5 MiB of whitespace, no Content-Length
    response = httpx.post(server.url + "/v1/completions", content=chunks(),
                          headers={**auth, **JSON}, timeout=30)
    assert_openai_error(response, 413)


# ---- a slow client ---------------------------------------------------------------------------------


async def _trickle_headers(url: str, stop: asyncio.Event) -> None:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"X-Slow: {'s' * 200}\r\n").encode()
    try:
        for byte in head:
            if stop.is_set():
                return
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0.01)
    finally:
        writer.close()


async def _served_while_trickling(url: str) -> list[float]:
    stop = asyncio.Event()
    tricklers = [asyncio.ensure_future(_trickle_headers(url, stop)) for _ in range(8)]
    await asyncio.sleep(0.3)  # every trickler is mid-head
    seconds = []
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as client:
            for _ in range(3):
                started = time.monotonic()
                response = await client.post("/v1/completions", json=NORMAL)
                assert response.status_code == 200
                seconds.append(time.monotonic() - started)
            assert all(not t.done() for t in tricklers)  # they were still trickling throughout
    finally:
        stop.set()
        await asyncio.gather(*tricklers, return_exceptions=True)
    return seconds


def test_a_client_trickling_its_headers_blocks_nobody(tiny):
    asyncio.run(asyncio.wait_for(_served_while_trickling(tiny.url), timeout=240))


# ---- clients that hang up together ---------------------------------------------------------------


async def _streams_dropped_together(url: str, count: int) -> int:
    """count streams, each held until it has sent a token, then all closed at once;
    returns how many were streaming (the rest were refused with 429)."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": True,
            "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=url, timeout=60, headers=headers,
                                 limits=httpx.Limits(max_connections=count)) as client:
        async def open_one():
            response = await client.send(client.build_request("POST", "/v1/completions", json=body),
                                         stream=True)
            if response.status_code != 200:
                await response.aread()
                assert response.status_code == 429, response.text
                await response.aclose()
                return None
            lines = response.aiter_lines()
            while not (await lines.__anext__()).startswith("data:"):
                pass  # admitted and generating
            return response, lines

        opened = await asyncio.gather(*[open_one() for _ in range(count)])
        streaming = [o for o in opened if o is not None]
        for response, _ in streaming:
            await response.aclose()  # every client hangs up mid-stream, together
        return len(streaming)


def test_many_streams_dropped_at_once_free_everything(tiny):
    streaming = asyncio.run(asyncio.wait_for(_streams_dropped_together(tiny.url, 8), timeout=120))
    assert streaming >= 4
    assert_idle(wait_until_idle(tiny.url, timeout=120))


# ---- odds and ends ----------------------------------------------------------------------------------


@pytest.mark.parametrize("field_name", ["prompt", "stop"])
def test_union_fields_name_the_accepted_shapes(tiny, auth, field_name):
    response = httpx.post(tiny.url + "/v1/completions",
                          json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, field_name: {"x": 1}},
                          headers=auth)
    error = assert_openai_error(response, 400)
    assert error["param"] == field_name
    assert "a string" in error["message"]


def test_cors_is_off_by_default(tiny):
    preflight = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
    response = httpx.options(tiny.url + "/v1/completions", headers=preflight)
    assert "access-control-allow-origin" not in response.headers
