"""vLLM's server habits on a real `rooflm serve` process: /docs, an access log line per
request, and start-up progress printed without --log-level."""

import re
import time

import httpx
import pytest

from tests.server.server_utils import MODEL

pytestmark = [pytest.mark.timeout(300)]


def _log_lines(server, pattern: str, timeout: float = 10.0) -> list[str]:
    """The server log's lines matching `pattern`, waiting a little for them to be flushed."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [l for l in server.log_path.read_text(errors="replace").splitlines()
                 if re.search(pattern, l)]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.1)


def test_docs_page_and_schema_are_served_without_the_key(server):
    docs = httpx.get(server.url + "/docs", timeout=10)
    assert docs.status_code == 200
    assert "swagger-ui" in docs.text.lower() and "/openapi.json" in docs.text
    schema = httpx.get(server.url + "/openapi.json", timeout=10)
    assert schema.status_code == 200
    paths = schema.json()["paths"]
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/version"):
        assert path in paths, path
    # Everything else still needs the key.
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401


def test_access_log_line_per_request(server, auth):
    response = httpx.post(server.url + "/v1/completions", headers=auth, timeout=60,
                          json={"model": MODEL, "prompt": "Hello there", "max_tokens": 3,
                                "ignore_eos": True})
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    rid = response.headers["x-request-id"]
    lines = _log_lines(server, re.escape(f"request_id={rid}"))
    assert len(lines) == 1, lines
    line = lines[0]
    assert '"POST /v1/completions" 200 ' in line
    assert f"prompt_tokens={usage['prompt_tokens']} completion_tokens=3 " in line
    latency_ms = float(re.search(r" 200 ([\d.]+) ms ", line).group(1))
    assert 0 < latency_ms < 60_000
    # A refusal is logged too, with no tokens: it never reached the engine.
    denied = httpx.get(server.url + "/v1/models", headers={"X-Request-Id": "no-key-1"}, timeout=10)
    assert denied.status_code == 401
    (line,) = _log_lines(server, "request_id=no-key-1")
    assert '"GET /v1/models" 401 ' in line and "prompt_tokens=- completion_tokens=-" in line
    # A stream is logged when it ends, with what it generated.
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers=auth, timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                            "max_tokens": 4, "ignore_eos": True, "stream": True}) as stream:
        assert stream.status_code == 200
        rid = stream.headers["x-request-id"]
        body = "".join(stream.iter_text())
    assert "[DONE]" in body
    (line,) = _log_lines(server, re.escape(f"request_id={rid}"))
    assert '"POST /v1/chat/completions" 200 ' in line and "completion_tokens=4 " in line


def test_startup_progress_is_printed_by_default(server):
    # The main server runs without --log-level: these are the default output.
    log = server.log_path.read_text(errors="replace")
    order = [log.find("loading weights (gguf"), log.find("weights loaded in"),
             log.find("KV cache: 96 blocks"), log.find("ready in "), log.find("ready: serving")]
    assert all(i >= 0 for i in order), log[-3000:]
    assert order == sorted(order)
