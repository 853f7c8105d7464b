"""The front-end protocol (engine/client.py): each front end implements every member of
EngineClient with the protocol's own signature, the server reaches the front ends only through
it, and the request lifecycle the front ends share (TrackedRequest) records what it promises."""

import ast
import asyncio
import inspect
from pathlib import Path

import pytest

from rooflm.dp.client import DPClient
from rooflm.engine.async_engine import AsyncLLMEngine
from rooflm.engine.client import EngineClient, StepTokens, TrackedRequest, admit_group
from rooflm.engine.core_client import EngineCoreClient
from rooflm.engine.outputs import CompletionOutput, RequestOutput
from rooflm.engine.request_types import GenerateRequest
from rooflm.sampling_params import SamplingParams

FRONT_ENDS = [AsyncLLMEngine, EngineCoreClient, DPClient]
SERVER = Path(__file__).resolve().parents[2] / "rooflm" / "server"


def _protocol_members() -> list[str]:
    return sorted(EngineClient.__abstractmethods__)


def test_the_protocol_declares_what_the_server_calls():
    assert _protocol_members() == ["abort", "abort_all", "generate", "health", "is_dead",
                                   "is_sleeping", "num_in_flight", "shutdown", "sleep", "snapshot",
                                   "start", "stop", "wake_up"]


@pytest.mark.parametrize("front", FRONT_ENDS, ids=lambda f: f.__name__)
def test_each_front_end_implements_every_member(front):
    assert issubclass(front, EngineClient)
    assert not front.__abstractmethods__, f"{front.__name__} leaves abstract: " \
                                          f"{sorted(front.__abstractmethods__)}"
    for name in _protocol_members():
        declared = inspect.getattr_static(EngineClient, name)
        implemented = inspect.getattr_static(front, name)
        where = f"{front.__name__}.{name}"
        if isinstance(declared, property):
            assert isinstance(implemented, property), f"{where} must be a property"
            continue
        assert inspect.iscoroutinefunction(implemented) == inspect.iscoroutinefunction(declared), \
            f"{where}: async in one and not the other"
        assert inspect.signature(implemented) == inspect.signature(declared), \
            f"{where}{inspect.signature(implemented)} differs from the protocol's " \
            f"{inspect.signature(declared)}"


def _imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_the_server_uses_the_front_ends_only_through_the_protocol():
    # app.py picks the front end for where the engine runs; the rest of the server sees the
    # protocol only.
    implementations = {"rooflm.engine.async_engine", "rooflm.engine.core_client",
                       "rooflm.dp.client", "rooflm.engine.core"}
    for path in sorted(SERVER.glob("*.py")):
        if path.name == "app.py":
            continue
        used = _imported_modules(path) & implementations
        assert not used, f"server/{path.name} imports {sorted(used)}: use engine/client.py"


def test_the_core_process_does_not_import_a_front_end():
    core = Path(inspect.getfile(EngineClient)).parent / "core.py"
    assert not _imported_modules(core) & {"rooflm.engine.async_engine", "rooflm.engine.client"}


class RecordingMetrics:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args: self.calls.append((name, *args))


def _output(tokens: int, finished: bool) -> RequestOutput:
    sample = CompletionOutput(0, "", [7] * tokens, finish_reason="length" if finished else None)
    return RequestOutput("r", None, [1, 2, 3], [sample], finished)


def test_a_tracked_request_records_its_latencies_once_each():
    request = GenerateRequest("r", [1, 2, 3], SamplingParams(max_tokens=4), arrival_time=100.0)
    tracked = TrackedRequest(request, stream=None)
    metrics = RecordingMetrics()
    tracked.scheduled_time = 100.5
    counts = StepTokens()
    tracked.tokens_arrived(1, 101.0, metrics, counts)
    tracked.tokens_arrived(3, 101.25, metrics, counts)
    assert (counts.prompt, counts.generation) == (3, 4)
    tracked.observe_end(metrics, "length", 102.0, _output(4, finished=True))
    assert metrics.calls == [("observe_first_token", 1.0), ("observe_inter_token", 0.25),
                             ("observe_request", 3, [4], 0.5, 0.25),
                             ("observe_finished", "length", 2.0, 0.5)]


def test_an_aborted_or_warm_up_request_records_no_times():
    request = GenerateRequest("r", [1, 2, 3], SamplingParams(max_tokens=4), arrival_time=100.0)
    tracked = TrackedRequest(request, stream=None)
    metrics = RecordingMetrics()
    tracked.tokens_arrived(2, 101.0, metrics, StepTokens())
    tracked.observe_end(metrics, "abort", 102.0)
    assert metrics.calls[-1] == ("observe_finished", "abort", None, None)

    warm_up = TrackedRequest(GenerateRequest("w", [1], SamplingParams(max_tokens=1),
                                             record_metrics=False), stream=None)
    quiet, counts = RecordingMetrics(), StepTokens()
    warm_up.tokens_arrived(1, 101.0, quiet, counts)
    warm_up.observe_end(quiet, "length", 102.0, _output(1, finished=True))
    warm_up.observe_failure(quiet)
    assert quiet.calls == [] and (counts.prompt, counts.generation) == (0, 0)
    assert warm_up.first_token_time == 101.0  # its times are kept all the same


def test_a_cancelled_admission_aborts_its_group():
    requests = [GenerateRequest(f"r{i}", [1], SamplingParams(max_tokens=1)) for i in range(2)]
    aborted = []

    async def cancel_while_admitting():
        never: asyncio.Future = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(admit_group(requests, lambda streams: never, aborted.append))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_while_admitting())
    assert aborted == [["r0", "r1"]]
