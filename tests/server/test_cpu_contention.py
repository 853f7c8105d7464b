"""A CPU engine core beside CPU-bound competitors (engine/cpu_threads.py), bounded in time.

Two competitor processes spin on the cores (each stops by itself after two
minutes, and is killed at the end); the core is started with
ROOFLM_CPU_CONTENTION=on (the load average takes a minute to rise, too slow for
a test): it gets a passive OpenMP wait policy and fewer threads than cores in
its environment, and a burst of 8 concurrent 16-token requests all finishes.
No time is asserted: the benchmark (benchmarks/cpu_contention.py) measures.
"""

import asyncio
import os
import subprocess
import sys

import pytest

import rooflm.envs as envs
from rooflm.config import engine_config_from_kwargs
from rooflm.engine.core_client import EngineCoreClient
from rooflm.engine.core_process import EngineCoreProcess
from rooflm.engine.cpu_threads import usable_cores
from rooflm.engine.request_types import GenerateRequest
from rooflm.sampling_params import SamplingParams
from tests.models.tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(300)

SPIN = "import time\nend = time.monotonic() + 120\nwhile time.monotonic() < end: pass"


@pytest.fixture
def competitors():
    spinning = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(2)]
    try:
        yield spinning
    finally:
        for process in spinning:
            process.kill()
            process.wait(30)


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


@pytest.mark.exclusive
def test_a_core_beside_competitors_waits_passively_and_finishes_a_burst(tmp_path, competitors,
                                                                         monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("ROOFLM_CPU_THREADS", raising=False)
    path, _ = make_tiny_model(tmp_path, "llama", initializer_range=0.3)
    config = engine_config_from_kwargs(model=path, device="cpu", dtype="float32", num_blocks=64)

    async def burst(client: EngineCoreClient) -> list[int]:
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        streams = await client.generate([GenerateRequest(f"r{i}", list(range(1, 33)), params)
                                         for i in range(8)])
        counts = []
        for stream in streams:
            out = None
            while not stream.finished:
                out = await asyncio.wait_for(stream.next(), 120)
            counts.append(len(out.outputs[0].token_ids))
        return counts

    async def run():
        with envs.override("ROOFLM_CPU_CONTENTION", "on"):
            client = EngineCoreClient(EngineCoreProcess.launch(config))
        client.start()
        try:
            environ = _environ(client.core.process.pid)
            assert environ.get("OMP_WAIT_POLICY") == "PASSIVE"
            assert environ.get("ROOFLM_CPU_THREADS") == str(max(1, usable_cores() - 1))
            return await burst(client)
        finally:
            await client.shutdown()

    assert asyncio.run(run()) == [16] * 8
    # The API process's own environment is as it was.
    assert "OMP_WAIT_POLICY" not in os.environ
