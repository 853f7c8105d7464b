"""`rooflm serve --tensor-parallel-size 2` on the CPU (gloo): it serves, and a worker that dies
makes the server unhealthy (503) with no hang, the engine core and the other ranks gone."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from tests.models.tiny_models import make_tiny_model
from tests.server.server_utils import assert_openai_error, engine_core_pid, pid_gone, start_server


@pytest.fixture
def tp_server(tmp_path):
    path, _ = make_tiny_model(tmp_path, "llama", attention="gqa")
    server = start_server(tmp_path, "tp2", [
        "--model", str(path), "--tensor-parallel-size", "2", "--device", "cpu", "--dtype", "float32",
        "--max-model-len", "256", "--num-blocks", "64", "--log-interval", "0", "--keep-running-on-error",
        "--no-engine-restart"])
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_a_tp_server_serves_and_a_dead_worker_makes_it_unhealthy(tp_server):
    url = tp_server.url
    body = {"model": "llama-gqa-untied-seed0", "prompt": [5, 9, 33, 7], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    response = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 8
    core = engine_core_pid(tp_server.proc.pid)
    worker = engine_core_pid(core)  # rank 1: the core's spawned child
    assert core is not None and worker is not None
    os.kill(worker, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        health = httpx.get(url + "/health", timeout=5)
        if health.status_code == 503:
            break
        time.sleep(0.2)
    assert "exited with code -9" in assert_openai_error(health, 503)["message"]
    assert pid_gone(core, timeout=15)
    refused = httpx.post(url + "/v1/completions", json=body, timeout=10)
    assert assert_openai_error(refused, 503)["code"] == "engine_error"


def test_a_worker_that_raises_makes_the_server_report_its_rank_and_error(tmp_path):
    """The worker's own exception, not a collective's timeout, is what /health reports."""
    path, _ = make_tiny_model(tmp_path, "llama", attention="gqa")
    server = start_server(tmp_path, "tp2-fault", [
        "--model", str(path), "--tensor-parallel-size", "2", "--device", "cpu", "--dtype", "float32",
        "--max-model-len", "256", "--num-blocks", "64", "--log-interval", "0", "--keep-running-on-error",
        "--no-engine-restart"],
        env={"ROOFLM_TP_FAULT_INJECT": "1:2"})
    try:
        server.wait_ready()
        body = {"model": "llama-gqa-untied-seed0", "prompt": [5, 9, 33, 7], "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
        started = time.monotonic()
        failed = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert failed.status_code >= 500, failed.text
        assert time.monotonic() - started < 20
        health = httpx.get(server.url + "/health", timeout=5)
        message = assert_openai_error(health, 503)["message"]
        assert "rank 1" in message and "fault injected at tp rank 1 step 2" in message
    finally:
        server.stop()
