"""Engine-core restart (engine/core_client.py's RestartPolicy), driven over the real sockets.

A 2-layer random model, one sequence at a time (so requests queue in the
core): a SIGKILLed core is replaced by a fresh one; a request that had streamed
tokens fails saying so, the queued ones run to their end on the new core,
health says "restarting" until it is back; and a core that dies max_deaths
times within the window stays down. The router of data parallelism sends
nothing to a restarting replica.
"""

import asyncio
import os
import signal
from types import SimpleNamespace

import pytest

from rooflm.config import engine_config_from_kwargs
from rooflm.engine.core_client import EngineCoreClient, RestartPolicy
from rooflm.engine.core_process import EngineCoreProcess
from rooflm.engine.request_types import EngineDeadError, GenerateRequest
from rooflm.sampling_params import SamplingParams
from tests.models.tiny_models import make_tiny_model
from tests.unit.test_dp_client import StandInDPClient

# Each restart starts a core process (a fresh interpreter importing torch): seconds each.
pytestmark = pytest.mark.timeout(300)

PROMPT = list(range(1, 11))
WAIT_S = 120  # generous: a restart on a loaded 2-core machine is slow, never stuck


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path, _ = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", initializer_range=0.3)
    return engine_config_from_kwargs(model=path, device="cpu", dtype="float32", num_blocks=32,
                                     max_num_seqs=1)


def _greedy(request_id: str, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(request_id, PROMPT, SamplingParams(max_tokens=max_tokens,
                                                              temperature=0.0, ignore_eos=True))


async def _drain(stream) -> int:
    """The tokens a stream delivers to its end."""
    out = None
    while not stream.finished:
        out = await asyncio.wait_for(stream.next(), WAIT_S)
    return len(out.outputs[0].token_ids)


async def _wait_for(condition) -> None:
    async def poll():
        while not condition():
            await asyncio.sleep(0.02)
    await asyncio.wait_for(poll(), WAIT_S)


def test_a_killed_core_restarts_and_runs_what_was_queued(config):
    async def run():
        died = []
        client = EngineCoreClient(EngineCoreProcess.launch(config),
                                  restart=RestartPolicy(enabled=True))
        client.start(on_dead=died.append)
        try:
            old_pid = client.core.process.pid
            running = (await client.generate([_greedy("running", 400)]))[0]
            await asyncio.wait_for(running.next(), WAIT_S)  # it has streamed a token
            # One sequence at a time: these wait in the core's queue, with nothing streamed.
            queued = await client.generate([_greedy("queued-a", 5), _greedy("queued-b", 7)])
            os.kill(old_pid, signal.SIGKILL)
            await _wait_for(lambda: client.is_restarting)
            assert "restarting" in client.health(stall_seconds=30)
            # A request that arrives now waits for the new core.
            late = asyncio.ensure_future(client.generate([_greedy("late", 3)]))
            with pytest.raises(EngineDeadError, match="had produced tokens"):
                await _drain(running)
            assert [await _drain(s) for s in queued] == [5, 7]
            assert await _drain((await asyncio.wait_for(late, WAIT_S))[0]) == 3
            assert client.health(stall_seconds=30) is None
            assert not client.is_dead and not died and client.num_restarts == 1
            assert client.core.process.pid != old_pid
            assert client.num_in_flight == 0
        finally:
            await client.shutdown()
        assert not client.core.process.is_alive()

    asyncio.run(run())


def test_the_crash_loop_guard_leaves_the_core_down(config):
    async def run():
        died = []
        client = EngineCoreClient(EngineCoreProcess.launch(config),
                                  restart=RestartPolicy(enabled=True, max_deaths=3, window_s=600))
        client.start(on_dead=died.append)
        try:
            for kill in range(3):
                await _wait_for(lambda: client.health(30) is None or client.is_dead)
                os.kill(client.core.process.pid, signal.SIGKILL)
                if kill < 2:
                    await _wait_for(lambda: client.is_restarting)
            await _wait_for(lambda: client.is_dead)
            assert "crash-loop guard" in client.health(stall_seconds=30)
            assert len(died) == 1 and client.num_restarts == 2
            with pytest.raises(EngineDeadError, match="crash-loop"):
                await client.generate([_greedy("after", 2)])
        finally:
            await client.shutdown()

    asyncio.run(run())



def test_the_router_sends_nothing_to_a_restarting_replica():
    engine = SimpleNamespace(replicas=[SimpleNamespace(index=i) for i in range(2)],
                             info=SimpleNamespace(block_size=4, num_blocks=100))
    dp = StandInDPClient(engine, policy="round_robin", restart=RestartPolicy(enabled=True))
    dp.clients[0].is_restarting = True

    async def send(count: int):
        for i in range(count):
            await dp.generate([GenerateRequest(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=2))])

    asyncio.run(send(4))
    assert len(dp.clients[0].admitted) == 0 and len(dp.clients[1].admitted) == 4
    assert not dp.is_restarting  # one replica still serves
    dp.clients[0].is_restarting = False
    asyncio.run(send(4))
    assert len(dp.clients[0].admitted) > 0
