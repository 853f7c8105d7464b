"""Helpers for the server tests: real `rooflm serve` processes on 127.0.0.1, and /metrics.

Every server is a subprocess on a free port, serving the default model with a
small context and KV pool so that it starts and answers fast on a CPU. Each is
stopped (SIGTERM, then SIGKILL after a deadline) by the fixture that started
it, whatever the tests did; its log goes to a file whose tail is printed when
it fails to start.

The main server (session-scoped, shared by the API, hostile, overload and
abandon tests) runs with an API key and tight admission limits:
  --max-queued-requests 4, --max-tokens-in-flight 1024, 96 KV blocks of 16.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
API_KEY = "test-key-0123456789"
# Waits on /ready, so a quiet machine never waits this long; four servers loading the model at
# once on 2 cores at load 9 took over 3 minutes.
STARTUP_TIMEOUT_S = 600
STOP_TIMEOUT_S = 30

# The smallest configuration every server test can live with.
SMALL_ENGINE_ARGS = ["--max-model-len", "512", "--num-blocks", "96", "--log-interval", "0"]
MAIN_SERVER_ARGS = SMALL_ENGINE_ARGS + [
    "--api-key", API_KEY, "--max-queued-requests", "4", "--max-tokens-in-flight", "1024",
    "--request-timeout", "120"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """One `python -m rooflm serve` subprocess."""

    def __init__(self, args: list[str], log_path: Path, env: Optional[dict[str, str]] = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [sys.executable, "-m", "rooflm", "serve", "--host", "127.0.0.1",
                   "--port", str(self.port), *args]
        full_env = dict(os.environ)
        full_env.pop("ROOFLM_FAULT_INJECT_STEP", None)
        full_env.pop("ROOFLM_API_KEY", None)
        full_env.update(env or {})
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(command, cwd=REPO_ROOT, env=full_env, stdout=self._log,
                                     stderr=subprocess.STDOUT)

    def log_tail(self, chars: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_bytes()[-chars:].decode("utf-8", "replace")

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log_tail()}")

    def wait_exit(self, timeout: float) -> Optional[int]:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> Optional[int]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            if self.wait_exit(STOP_TIMEOUT_S) is None:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def _parent_and_state(pid: int) -> Optional[tuple[int, str]]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), fields[0]


def engine_core_pid(server_pid: int) -> Optional[int]:
    """The pid of a server's engine-core process (a multiprocessing 'spawn' child), if any."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or (_parent_and_state(int(entry)) or (0, ""))[0] != server_pid:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    return int(entry)
        except OSError:
            continue
    return None


def pid_gone(pid: int, timeout: float = 0.0) -> bool:
    """Whether the process has exited (a zombie counts as gone) within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        found = _parent_and_state(pid)
        if found is None or found[1] == "Z":
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def start_server(tmp_dir: Path, name: str, args: list[str],
                 env: Optional[dict[str, str]] = None) -> ServerProcess:
    return ServerProcess(args, tmp_dir / f"{name}.log", env)


# ---- metrics ------------------------------------------------------------------------------------------------


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, parsed by prometheus_client: (name, sorted labels) -> value."""
    response = httpx.get(url + "/metrics", timeout=60)
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def metric(samples: dict, name: str, **labels) -> float:
    """The value of one series; model_name and engine labels are implied."""
    wanted = {"model_name": MODEL, "engine": "0", **labels}
    key = (name, tuple(sorted(wanted.items())))
    assert key in samples, f"no series {name}{labels} in /metrics"
    return samples[key]


def wait_until_idle(url: str, timeout: float = 30.0) -> dict:
    """Poll /metrics until nothing runs, nothing waits and every KV block is free."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(url)
        idle = (metric(samples, "vllm:num_requests_running") == 0
                and metric(samples, "vllm:num_requests_waiting") == 0
                and metric(samples, "vllm:kv_cache_usage_perc") == 0
                and metric(samples, "rooflm:kv_free_blocks") == metric(samples, "rooflm:kv_num_blocks")
                and metric(samples, "rooflm:tokens_in_flight") == 0)
        if idle or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


def assert_idle(samples: dict) -> None:
    assert metric(samples, "vllm:num_requests_running") == 0
    assert metric(samples, "vllm:num_requests_waiting") == 0
    assert metric(samples, "vllm:kv_cache_usage_perc") == 0
    assert metric(samples, "rooflm:kv_free_blocks") == metric(samples, "rooflm:kv_num_blocks")
    assert metric(samples, "rooflm:tokens_in_flight") == 0


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    """The status, and OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    return error
