"""`rooflm serve` restarting its engine core (the default, --engine-restart), on 127.0.0.1.

The default model, one sequence at a time: a stream runs, six requests wait
behind it, and the core is SIGKILLed. The stream ends with an error event
saying its tokens cannot be taken back; the six waiting ones are answered 200
by the new core (none lost, none hung); /health and /ready come back. A tiny
model's server, SIGKILLed five times, trips the crash-loop guard and stays down.
"""

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from tests.models.tiny_models import make_tiny_model_with_tokenizer
from tests.server.server_utils import (MODEL, SMALL_ENGINE_ARGS, engine_core_pid, metric, pid_gone,
                                       scrape, start_server)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WAIT_S = 240  # generous bounds: a restart on a loaded 2-core machine is slow, never stuck
WAITING = 6


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine-restart")
    tiny = make_tiny_model_with_tokenizer(tmp / "tiny")
    started = {
        "default": start_server(tmp, "default", SMALL_ENGINE_ARGS + ["--max-num-seqs", "1"]),
        # A long window: five restarts on a loaded machine must still count as a loop.
        "tiny": start_server(tmp, "tiny", ["--model", tiny, "--device", "cpu", "--dtype",
                                           "float32", "--num-blocks", "32", "--log-interval", "0",
                                           "--served-model-name", "tiny",
                                           "--keep-running-on-error",
                                           "--engine-restart-window-s", "900"]),
    }
    try:
        for process in started.values():
            process.wait_ready()
        yield started
    finally:
        for process in started.values():
            process.stop()


def _core_pid(server) -> int:
    deadline = time.monotonic() + WAIT_S
    while (pid := engine_core_pid(server.proc.pid)) is None:
        assert time.monotonic() < deadline, "no engine core process"
        time.sleep(0.1)
    return pid


def _wait_status(server, path: str, status: int) -> httpx.Response:
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            response = httpx.get(server.url + path, timeout=10)
            if response.status_code == status:
                return response
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{path} never answered {status}"
        time.sleep(0.1)


async def _kill_under_load(server) -> tuple[list, list[httpx.Response], bool]:
    stream_body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400,
                   "ignore_eos": True, "stream": True}
    waiting_body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8,
                    "ignore_eos": True}
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S,
                                 limits=httpx.Limits(max_connections=WAITING + 4)) as client:
        events, waiting, saw_503 = [], [], False
        async with client.stream("POST", "/v1/completions", json=stream_body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events.append(json.loads(line[len("data: "):]))
                if len(events) == 1:
                    # The one sequence slot is the stream's: these wait in the core's queue.
                    waiting = [asyncio.ensure_future(client.post("/v1/completions", json=waiting_body))
                               for _ in range(WAITING)]
                    await asyncio.to_thread(_wait_waiting, server, WAITING)
                    os.kill(_core_pid(server), signal.SIGKILL)
                    saw_503 = (await asyncio.to_thread(_wait_status, server, "/health", 503)) is not None
        answers = await asyncio.gather(*waiting)
    return events, answers, saw_503


def _wait_waiting(server, count: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while metric(scrape(server.url), "vllm:num_requests_waiting") != count:
        assert time.monotonic() < deadline, f"never {count} requests waiting"
        time.sleep(0.05)


def test_a_core_killed_under_load_comes_back_and_loses_no_waiting_request(servers):
    server = servers["default"]
    old_pid = _core_pid(server)
    events, answers, saw_503 = asyncio.run(asyncio.wait_for(_kill_under_load(server), 2 * WAIT_S))
    assert saw_503  # /health said so while the new core started
    error = events[-1]["error"]
    assert error["code"] == "engine_error" and "produced tokens" in error["message"]
    assert [a.status_code for a in answers] == [200] * WAITING, [a.text[:200] for a in answers]
    assert all(a.json()["usage"]["completion_tokens"] == 8 for a in answers)
    _wait_status(server, "/health", 200)
    _wait_status(server, "/ready", 200)
    assert _core_pid(server) != old_pid and pid_gone(old_pid, timeout=30)
    after = httpx.post(server.url + "/v1/completions", timeout=WAIT_S, json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 2, "ignore_eos": True})
    assert after.status_code == 200


def test_five_deaths_trip_the_crash_loop_guard(servers):
    server = servers["tiny"]
    for kill in range(5):
        _wait_status(server, "/health", 200)
        pid = _core_pid(server)
        os.kill(pid, signal.SIGKILL)
        assert pid_gone(pid, timeout=WAIT_S)
        if kill < 4:
            _wait_status(server, "/health", 503)  # restarting
    deadline = time.monotonic() + WAIT_S
    while "crash-loop guard" not in (health := httpx.get(server.url + "/health", timeout=10)).text:
        assert time.monotonic() < deadline, health.text
        time.sleep(0.1)
    assert health.status_code == 503
    refused = httpx.post(server.url + "/v1/completions", timeout=30,
                         json={"model": "tiny", "prompt": "w5 w6", "max_tokens": 2})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_error"
    time.sleep(1)
    assert engine_core_pid(server.proc.pid) is None  # it stays down
    assert server.proc.poll() is None  # --keep-running-on-error
