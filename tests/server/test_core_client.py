"""The engine core in its own process, driven from this process over its real ZMQ sockets.

A 2-layer random model without a tokenizer (prompts are token ids; text is
empty): the outputs rebuilt from the core's per-step deltas equal what the
in-process engine returns; admission, aborts, engine death and a killed core
behave as with the engine thread; and every frame on the sockets is msgpack
that msgspec decodes, never pickle.
"""

import asyncio
import inspect
import os
import pickle
import signal
import time

import msgspec
import pytest

from rooflm.config import engine_config_from_kwargs
from rooflm.engine import core, core_client, core_process, core_protocol
from rooflm.engine.core_client import EngineCoreClient
from rooflm.engine.core_process import EngineCoreProcess
from rooflm.engine.core_protocol import (AddReply, AddRequests, Configure, EngineReady, Heartbeat,
                                         Shutdown, StepOutputs)
from rooflm.engine.llm_engine import LLMEngine
from rooflm.engine.request_types import (AdmissionLimits, AdmissionRejected, EngineDeadError,
                                         GenerateRequest, RequestAborted)
from rooflm.errors import InvalidRequest
from rooflm.sampling_params import SamplingParams
from tests.models.tiny_models import make_tiny_model

# Each test starts a core process (a fresh interpreter importing torch): seconds, not minutes.
pytestmark = pytest.mark.timeout(120)

PROMPT = list(range(1, 11))


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path, _ = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", initializer_range=0.3)
    return engine_config_from_kwargs(model=path, device="cpu", dtype="float32", num_blocks=16)


def _requests() -> list[GenerateRequest]:
    """Greedy with logprobs and prompt logprobs; n=2 seeded; a stop token; one output only."""
    return [
        GenerateRequest("greedy", PROMPT, SamplingParams(max_tokens=6, temperature=0.0, logprobs=2,
                                                         prompt_logprobs=1, ignore_eos=True)),
        GenerateRequest("pair", PROMPT[:7], SamplingParams(n=2, max_tokens=5, temperature=1.0,
                                                           seed=7, ignore_eos=True)),
        GenerateRequest("stop", PROMPT[3:], SamplingParams(max_tokens=8, temperature=1.0, seed=3,
                                                           ignore_eos=True,
                                                           stop_token_ids=list(range(0, 256, 2)))),
        GenerateRequest("final", PROMPT[2:], SamplingParams(max_tokens=4, temperature=0.0, logprobs=1,
                                                            ignore_eos=True, output_kind="final")),
    ]


def _in_process(config) -> dict:
    engine = LLMEngine(config)
    for r in _requests():
        engine.add_request(r.request_id, r.prompt_token_ids, r.params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


async def _through_the_core(client: EngineCoreClient) -> tuple[dict, dict]:
    streams = await client.generate(_requests())
    finals, streamed = {}, {}
    for stream in streams:
        while not stream.finished:
            out = await asyncio.wait_for(stream.next(), 30)
            for sample, ids in zip(out.outputs, out.delta_token_ids):
                streamed.setdefault((out.request_id, sample.index), []).extend(ids)
        finals[out.request_id] = out
    return finals, streamed


def _client(config, limits=None) -> EngineCoreClient:
    return EngineCoreClient(EngineCoreProcess.launch(config), limits)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_outputs_through_the_core_equal_the_engines(config):
    expected = _in_process(config)

    async def run():
        client = _client(config)
        client.start()
        try:
            return await _through_the_core(client), client.snapshot
        finally:
            await client.shutdown()

    (finals, streamed), snapshot = asyncio.run(run())
    assert set(finals) == set(expected)
    for request_id, want in expected.items():
        got = finals[request_id]
        assert got.finished and got.prompt_logprobs == want.prompt_logprobs
        assert got.num_cached_tokens == want.num_cached_tokens
        assert len(got.outputs) == len(want.outputs)
        for g, w in zip(got.outputs, want.outputs):
            assert (g.index, g.token_ids, g.logprobs) == (w.index, w.token_ids, w.logprobs)
            assert (g.finish_reason, g.stop_reason) == (w.finish_reason, w.stop_reason)
            assert streamed[(request_id, g.index)] == g.token_ids  # the deltas add up
    assert len(finals["final"].outputs[0].token_ids) == 4
    assert finals["pair"].outputs[0].token_ids != finals["pair"].outputs[1].token_ids
    assert finals["stop"].outputs[0].finish_reason == "stop"
    assert snapshot.num_free_blocks == snapshot.num_blocks  # every block came back


def test_admission_and_refusals_come_back_as_in_process(config):
    async def run():
        client = _client(config, AdmissionLimits(max_queued_requests=1))
        client.start()
        try:
            params = SamplingParams(max_tokens=2, temperature=0.0)
            with pytest.raises(AdmissionRejected, match="requests are waiting"):
                await client.generate([GenerateRequest(f"q{i}", PROMPT, params) for i in range(2)])
            with pytest.raises(InvalidRequest) as refused:
                await client.generate([GenerateRequest("bad", [999], params)])
            assert refused.value.param == "prompt"
            long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            streams = await client.generate([GenerateRequest("long", PROMPT, long)])
            await streams[0].next()
            client.abort_all("the test says stop")
            with pytest.raises(RequestAborted, match="the test says stop"):
                while True:
                    await streams[0].next()
            assert client.num_in_flight == 0
            deadline = time.monotonic() + 60
            while client.snapshot.num_free_blocks != client.snapshot.num_blocks:
                assert time.monotonic() < deadline, client.snapshot
                await asyncio.sleep(0.05)
            assert client.health(stall_seconds=30) is None
        finally:
            await client.shutdown()
        assert client.core.exitcode == 0

    asyncio.run(run())


def test_a_failing_step_fails_in_flight_requests(config, monkeypatch):
    monkeypatch.setenv("ROOFLM_FAULT_INJECT_STEP", "3")  # the spawned core reads it at start-up
    died = []

    async def run():
        client = _client(config)
        client.start(on_dead=died.append)
        try:
            params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
            streams = await client.generate([GenerateRequest("doomed", PROMPT, params)])
            with pytest.raises(EngineDeadError, match="fault injected at engine step 3"):
                while True:
                    await asyncio.wait_for(streams[0].next(), 30)
            assert "fault injected" in client.health(stall_seconds=30)
            with pytest.raises(EngineDeadError):
                await client.generate([GenerateRequest("late", PROMPT, params)])
            await asyncio.to_thread(client.core.join, 10)
            assert client.core.exitcode == 1
        finally:
            await client.shutdown()

    asyncio.run(run())
    assert len(died) == 1 and isinstance(died[0], EngineDeadError)


def test_a_killed_core_fails_in_flight_requests(config):
    async def run():
        client = _client(config)
        client.start()
        try:
            params = SamplingParams(max_tokens=230, temperature=0.0, ignore_eos=True)
            streams = await client.generate([GenerateRequest("orphaned", PROMPT, params)])
            await streams[0].next()
            os.kill(client.core.process.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="exited with code -9"):
                while True:
                    await asyncio.wait_for(streams[0].next(), 10)
            assert "exited" in client.health(stall_seconds=30) and client.is_dead
        finally:
            await client.shutdown()

    asyncio.run(run())


def test_a_stalled_core_is_unhealthy(config):
    async def run():
        client = _client(config)
        client.start()
        try:
            # Each state is waited for, not slept into: a loaded machine delays heartbeats, and
            # only a stopped core can never send one.
            await _health_until(client, lambda h: h is None, "idle: heartbeats")
            os.kill(client.core.process.pid, signal.SIGSTOP)
            await _health_until(client, lambda h: h is not None and "no progress" in h, "stopped: stalled")
            os.kill(client.core.process.pid, signal.SIGCONT)
            await _health_until(client, lambda h: h is None, "resumed: healthy again")
        finally:
            os.kill(client.core.process.pid, signal.SIGCONT)
            await client.shutdown()

    asyncio.run(run())


async def _health_until(client, wanted, what: str, bound_s: float = 60.0) -> None:
    deadline = time.monotonic() + bound_s
    while not wanted(health := client.health(stall_seconds=1.0)):
        assert time.monotonic() < deadline, f"{what}: health still {health!r} after {bound_s} s"
        await asyncio.sleep(0.1)


def test_close_ends_a_core_never_served(config):
    handle = EngineCoreProcess.launch(config)
    pid = handle.process.pid
    handle.close()  # no client ever started: close() itself sends Shutdown
    assert handle.exitcode == 0 and _gone(pid)
    assert not os.path.exists(handle.socket_dir)


# ---- no pickle on any socket ------------------------------------------------------------------------


def test_the_protocol_modules_never_pickle():
    for module in (core_protocol, core, core_client, core_process):
        source = inspect.getsource(module)
        assert "import pickle" not in source and "_pyobj" not in source, module.__name__
    assert isinstance(core_protocol.encoder(), msgspec.msgpack.Encoder)


def _frames_until(socket, predicate, timeout: float = 30.0) -> list[bytes]:
    frames = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if socket.poll(100):
            frames.append(socket.recv())
            if predicate(core_protocol.output_decoder().decode(frames[-1])):
                return frames
    raise AssertionError("the core did not answer in time")


def test_every_frame_is_msgpack_and_pickle_is_refused(config):
    """Drive a core by hand over its raw sockets: capture what it sends, send it a pickle."""
    handle = EngineCoreProcess.launch(config)
    encode = core_protocol.encoder().encode
    send = handle.input_socket.send
    try:
        send(encode(Configure(max_queued_requests=8, max_tokens_in_flight=0)))
        # A pickled message is bytes the core cannot decode as its schema: it is dropped,
        # never unpickled, and the core goes on serving.
        send(pickle.dumps({"type": "Shutdown"}))
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        send(encode(AddRequests(1, [GenerateRequest("r", PROMPT, params)])))
        frames = _frames_until(handle.output_socket, lambda m: isinstance(m, StepOutputs)
                               and any(d.finished for d in m.outputs))
        send(encode(Shutdown()))
        handle.join(10)
        assert handle.exitcode == 0
    finally:
        handle.close()
    kinds = set()
    for frame in frames:
        assert not frame.startswith(b"\x80")  # pickle's protocol 2+ opcode
        plain = msgspec.msgpack.decode(frame)  # any msgpack reader can read it: plain data
        assert isinstance(plain, dict) and "type" in plain
        kinds.add(type(core_protocol.output_decoder().decode(frame)))
    assert {AddReply, StepOutputs} <= kinds and kinds <= {AddReply, StepOutputs, Heartbeat,
                                                          EngineReady}


def test_serve_runs_the_engine_in_its_own_process_by_default():
    from rooflm.cli import build_parser

    assert build_parser().parse_args(["serve"]).engine_process is True
    assert build_parser().parse_args(["serve", "--no-engine-process"]).engine_process is False
