"""`rooflm serve` with its engine in a process of its own (the default), on 127.0.0.1.

Streaming through the core, an abandoned stream's blocks freed, a core killed
under a request (error, 503, unhealthy, never a hang), no orphan when the
server is killed, and SIGTERM's drain ending both processes. The servers
start together, to share the model-loading time.
"""

import asyncio
import json
import os
import pstats
import signal
import time

import httpx
import pytest

from tests.server.server_utils import (MODEL, SMALL_ENGINE_ARGS, assert_idle, assert_openai_error,
                                       engine_core_pid, metric, pid_gone, scrape, start_server,
                                       wait_until_idle)

# Real server processes: the real model, bounded in time even without --timeout.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LONG = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True,
        "stream": True}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine-process")
    started = {
        # Its core runs under cProfile (ROOFLM_ENGINE_CORE_PROFILE): the SIGTERM test reads the stats.
        "core": start_server(tmp, "core", SMALL_ENGINE_ARGS,
                             env={"ROOFLM_ENGINE_CORE_PROFILE": str(tmp / "core.prof")}),
        # --no-engine-restart: the server as a whole fails (a restart is test_engine_restart's).
        "crash": start_server(tmp, "crash", SMALL_ENGINE_ARGS + ["--keep-running-on-error",
                                                                 "--no-engine-restart"]),
        "orphan": start_server(tmp, "orphan", SMALL_ENGINE_ARGS),
        "thread": start_server(tmp, "thread", SMALL_ENGINE_ARGS + ["--no-engine-process",
                                                                   "--disable-log-requests"]),
    }
    try:
        for process in started.values():
            process.wait_ready()
        yield started
    finally:
        for process in started.values():
            process.stop()


def _events(lines: list[str]) -> list:
    return [line[len("data: "):] if line == "data: [DONE]" else json.loads(line[len("data: "):])
            for line in lines if line.startswith("data: ")]


def _core_pid(server) -> int:
    pid = engine_core_pid(server.proc.pid)
    assert pid is not None and pid != server.proc.pid
    return pid


def test_streams_through_the_engine_core(servers):
    server = servers["core"]
    _core_pid(server)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        events = _events(list(response.iter_lines()))
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-2] if e["choices"]]
    assert len(chunks) >= 6  # a chunk per step that produced text, not one at the end
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"]["completion_tokens"] == 12
    # Stop strings are matched in the core, across token boundaries.
    stopped = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "stop": [" "]}).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert " " not in stopped["choices"][0]["text"]


def test_a_dropped_stream_frees_its_blocks(servers):
    server = servers["core"]
    before = wait_until_idle(server.url)
    assert_idle(before)
    with httpx.stream("POST", server.url + "/v1/completions", json=LONG, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        while len(_events([next(lines)])) == 0:
            pass
        held = scrape(server.url)
        assert metric(held, "rooflm:kv_free_blocks") < metric(held, "rooflm:kv_num_blocks")
    # The connection is closed: the server aborts the request, the core frees its blocks.
    after = wait_until_idle(server.url)
    assert_idle(after)
    aborted = ("vllm:request_success_total", {"finished_reason": "abort"})
    assert metric(after, aborted[0], **aborted[1]) - metric(before, aborted[0], **aborted[1]) == 1


def test_no_engine_process_keeps_the_engine_thread(servers):
    server = servers["thread"]
    assert engine_core_pid(server.proc.pid) is None
    response = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
    # --disable-log-requests: no access line (they carry "request_id="), and the engine's own
    # start-up lines still come, from the thread.
    log = server.log_path.read_text(errors="replace")
    assert "request_id=" not in log and "rooflm.server.access" not in log
    assert "weights loaded in" in log and "ready in " in log


async def _stream_while_the_core_dies(server, core_pid: int) -> list:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        async with client.stream("POST", "/v1/completions", json=LONG) as response:
            assert response.status_code == 200
            lines = []
            async for line in response.aiter_lines():
                lines.append(line)
                if len(_events(lines)) == 1:
                    os.kill(core_pid, signal.SIGKILL)
            return _events(lines)


def test_a_killed_core_fails_requests_and_the_server_says_so(servers):
    server = servers["crash"]
    core_pid = _core_pid(server)
    events = asyncio.run(asyncio.wait_for(_stream_while_the_core_dies(server, core_pid), 60))
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "engine_error"
    assert "exited with code -9" in events[-2]["error"]["message"]
    health = httpx.get(server.url + "/health")
    assert "exited" in assert_openai_error(health, 503)["message"]
    assert httpx.get(server.url + "/ready").status_code == 503
    refused = httpx.post(server.url + "/v1/completions", timeout=10, json={**LONG, "stream": False})
    assert assert_openai_error(refused, 503)["code"] == "engine_error"
    assert metric(scrape(server.url), "vllm:request_success_total", finished_reason="error") == 1
    time.sleep(1)
    assert server.proc.poll() is None  # --keep-running-on-error


def _socket_dirs(pid: int) -> set[str]:
    """The directories of the ipc:// socket files a process has bound (Linux /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    with open("/proc/net/unix") as f:
        rows = [line.split() for line in f.read().splitlines()[1:]]
    return {os.path.dirname(row[7]) for row in rows if len(row) > 7 and row[6] in inodes}


def test_the_core_exits_when_the_server_is_killed(servers):
    server = servers["orphan"]
    core_pid = _core_pid(server)
    socket_dirs = _socket_dirs(core_pid)
    assert socket_dirs
    server.proc.kill()
    server.proc.wait(10)
    assert pid_gone(core_pid, timeout=120), "the engine core outlived its server"
    assert not any(os.path.exists(d) for d in socket_dirs)  # nor did its socket files


def test_sigterm_drains_then_both_processes_exit(servers):
    server = servers["core"]
    core_pid = _core_pid(server)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 16, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        first = next(lines)
        server.proc.send_signal(signal.SIGTERM)
        events = _events([first, *lines])
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert server.wait_exit(timeout=30) == 0
    assert pid_gone(core_pid, timeout=120)
    # The profile hook wrote the core's serving loop's stats when the core exited.
    stats = pstats.Stats(str(server.log_path.parent / "core.prof"))
    assert any(name == "_step" for _, _, name in stats.stats)
