"""AsyncLLMEngine against a fake LLMEngine: admission, aborts, failure and stall detection.

The fake produces one token per step per request and can be told to block in
step(), which no real model can be made to do on demand.
"""

import asyncio
import threading
from types import SimpleNamespace

import pytest

from rooflm.engine.async_engine import AsyncLLMEngine
from rooflm.engine.outputs import CompletionOutput, RequestOutput
from rooflm.engine.report import EngineSnapshot
from rooflm.engine.request import RequestStatus
from rooflm.engine.request_types import (AdmissionLimits, AdmissionRejected, EngineDeadError,
                                         GenerateRequest, RequestAborted)
from rooflm.errors import InvalidRequest
from rooflm.sampling_params import SamplingParams


class FakeEngine:
    def __init__(self):
        self.scheduler = SimpleNamespace(waiting=[], running=[])
        self.stats = {"steps": 0, "generation_tokens": 0}
        self.requests = {}
        self.aborted = []
        self.block_step = threading.Event()  # cleared: step() hangs
        self.block_step.set()
        self.paused = False  # True: step() schedules nothing, requests stay waiting

    def snapshot(self):
        return EngineSnapshot(
            num_running_reqs=len(self.scheduler.running), num_waiting_reqs=len(self.scheduler.waiting),
            num_swapped_reqs=0, num_running_seqs=len(self.scheduler.running), num_free_blocks=8,
            num_blocks=8, running_context_tokens=0, num_preemptions=0, prefix_queried_tokens=0,
            prefix_hit_tokens=0, prompt_tokens=0, generation_tokens=self.stats["generation_tokens"],
            steps=self.stats["steps"])

    @property
    def num_steps(self):
        return self.stats["steps"]

    is_sleeping = False

    def check_priority(self, priority):
        pass

    def predicted_queue_wait(self, priority=0, arrival=None):
        return 0.0

    def add_request(self, request_id, prompt, params, arrival_time=None, cache_salt=None, priority=0,
                    lora_request=None):
        if prompt == [666]:
            raise InvalidRequest("prompt token id at index 0 is 666", param="prompt")
        request = SimpleNamespace(request_id=request_id, prompt=prompt, params=params,
                                  status=RequestStatus.WAITING, generated=[])
        self.requests[request_id] = request
        self.scheduler.waiting.append(request)
        return request

    def abort_request(self, request_ids):
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.pop(request_id, None)
            if request is not None:
                self.aborted.append(request_id)
                for queue in (self.scheduler.waiting, self.scheduler.running):
                    if request in queue:
                        queue.remove(request)
        return []

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        self.block_step.wait()
        if self.paused:
            return []
        self.scheduler.running.extend(self.scheduler.waiting)
        self.scheduler.waiting.clear()
        outputs = []
        for request in list(self.scheduler.running):
            request.status = RequestStatus.RUNNING
            request.generated.append(7)
            done = len(request.generated) >= request.params.max_tokens
            sample = CompletionOutput(0, "x" * len(request.generated), list(request.generated),
                                      finish_reason="length" if done else None)
            outputs.append(RequestOutput(request.request_id, None, request.prompt, [sample], done,
                                         delta_text=["x"], delta_token_ids=[[7]]))
            if done:
                self.scheduler.running.remove(request)
                del self.requests[request.request_id]
        self.stats["steps"] += 1
        self.stats["generation_tokens"] += len(outputs)
        return outputs


def _request(name, max_tokens=3, prompt=(1, 2)):
    return GenerateRequest(name, list(prompt), SamplingParams(max_tokens=max_tokens))


async def _collect(stream):
    outputs = [await stream.next(timeout=10)]
    while not outputs[-1].finished:
        outputs.append(await stream.next(timeout=10))
    return outputs


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


def test_generates_and_releases_everything():
    async def main():
        engine = AsyncLLMEngine(FakeEngine(), AdmissionLimits(4, 100))
        engine.start()
        streams = await engine.generate([_request("a"), _request("b", max_tokens=5)])
        results = [await _collect(s) for s in streams]
        await asyncio.sleep(0.3)
        engine.stop()
        return engine, results
    engine, results = _run(main())
    # A reader behind the engine gets the steps that piled up merged into one output: count
    # the tokens of the deltas, not the outputs.
    assert [sum(len(o.delta_token_ids[0]) for o in r) for r in results] == [3, 5]
    assert ["".join(o.delta_text[0] for o in r) for r in results] == ["xxx", "xxxxx"]
    assert results[0][-1].outputs[0].finish_reason == "length"
    assert engine.num_in_flight == 0 and engine._tokens_in_flight == 0


def test_a_slow_reader_gets_the_waiting_outputs_merged_and_errors_after_them():
    from rooflm.engine.client import RequestStream

    def output(i, finished=False):
        sample = CompletionOutput(0, "x" * i, [7] * i, finish_reason="length" if finished else None)
        return RequestOutput("r", None, [1], [sample], finished, delta_text=["x"], delta_token_ids=[[7]])

    async def main():
        stream = RequestStream("r")
        for i in (1, 2, 3):
            stream.put(output(i))
        stream.put(RuntimeError("engine died"))
        merged = await stream.next(timeout=1)
        with pytest.raises(RuntimeError, match="engine died"):
            await stream.next(timeout=1)
        return merged, stream.finished

    merged, finished = _run(main())
    assert merged.delta_token_ids == [[7, 7, 7]] and merged.delta_text == ["xxx"]
    assert merged.outputs[0].token_ids == [7, 7, 7] and not merged.finished
    assert finished


def test_queue_and_token_limits_refuse_fast():
    async def main():
        fake = FakeEngine()
        fake.paused = True  # nothing leaves the queue while we look
        engine = AsyncLLMEngine(fake, AdmissionLimits(max_queued_requests=2, max_tokens_in_flight=12))
        engine.start()
        await engine.generate([_request("a")])  # reserves 2 + 3 = 5 tokens
        with pytest.raises(AdmissionRejected, match="tokens in flight") as tokens:
            await engine.generate([_request("b", max_tokens=6)])  # 5 + 8 > 12
        await engine.generate([_request("c")])  # 10 tokens, 2 waiting
        with pytest.raises(AdmissionRejected, match="waiting") as queue:
            await engine.generate([_request("d", max_tokens=1)])
        fake.paused = False
        engine.stop()
        return tokens.value, queue.value
    tokens, queue = _run(main())
    assert tokens.status == queue.status == 429 and queue.retry_after_s == 1


def test_a_burst_in_one_command_batch_meets_the_queue_limit():
    """Adds that pile up while a step runs are applied together, between two published
    snapshots: each must count the ones admitted before it."""
    async def main():
        fake = FakeEngine()
        fake.paused = True
        engine = AsyncLLMEngine(fake, AdmissionLimits(max_queued_requests=2, max_tokens_in_flight=0))
        engine.start()
        await engine.generate([_request("first")])
        fake.block_step.clear()  # the engine thread hangs in its next step...
        await asyncio.sleep(0.1)
        burst = [asyncio.ensure_future(engine.generate([_request(f"b{i}")])) for i in range(5)]
        await asyncio.sleep(0.2)
        fake.block_step.set()  # ...and then finds the whole burst queued
        results = await asyncio.gather(*burst, return_exceptions=True)
        fake.paused = False
        engine.stop()
        return results
    results = _run(main())
    rejected = [r for r in results if isinstance(r, AdmissionRejected)]
    assert len(rejected) == 4 and "waiting" in str(rejected[0])


def test_a_bad_prompt_admits_none_of_its_group():
    async def main():
        fake = FakeEngine()
        fake.paused = True
        engine = AsyncLLMEngine(fake, AdmissionLimits(8, 0))
        engine.start()
        with pytest.raises(InvalidRequest, match="666") as refused:
            await engine.generate([_request("ok"), _request("bad", prompt=[666])])
        fake.paused = False
        engine.stop()
        return fake, engine, refused.value
    fake, engine, refused = _run(main())
    assert fake.aborted == ["ok"] and not fake.requests and engine.num_in_flight == 0
    assert refused.param == "prompt"  # the engine's error crosses the thread whole


def test_abort_with_a_reason_tells_the_waiting_stream():
    async def main():
        fake = FakeEngine()
        fake.paused = True
        engine = AsyncLLMEngine(fake, AdmissionLimits(8, 0))
        engine.start()
        [stream] = await engine.generate([_request("a", max_tokens=100)])
        engine.abort_all("the server is shutting down")
        with pytest.raises(RequestAborted, match="shutting down"):
            await stream.next(timeout=10)
        fake.paused = False
        engine.stop()
        return fake
    assert _run(main()).aborted == ["a"]


def test_a_failing_step_fails_everyone_and_reports_dead():
    async def main():
        dead = asyncio.Event()
        engine = AsyncLLMEngine(FakeEngine(), AdmissionLimits(8, 0), fault_inject_step=2)
        engine.start(on_dead=lambda exc: dead.set())
        streams = await engine.generate([_request("a", max_tokens=10), _request("b", max_tokens=10)])
        for stream in streams:
            with pytest.raises(EngineDeadError, match="fault injected at engine step 2"):
                await _collect(stream)
        await asyncio.wait_for(dead.wait(), 5)
        with pytest.raises(EngineDeadError):
            await engine.generate([_request("c")])
        health = engine.health(stall_seconds=60)
        engine.stop()
        return health
    assert "fault injected" in _run(main())


def test_a_stalled_step_makes_health_fail_until_it_moves():
    async def main():
        fake = FakeEngine()
        engine = AsyncLLMEngine(fake, AdmissionLimits(8, 0))
        engine.start()
        assert engine.health(stall_seconds=0.5) is None
        fake.block_step.clear()  # the next step hangs
        [stream] = await engine.generate([_request("a", max_tokens=2)])
        await asyncio.sleep(0.8)
        stalled = engine.health(stall_seconds=0.5)
        fake.block_step.set()
        await _collect(stream)
        recovered = engine.health(stall_seconds=0.5)
        engine.stop()
        return stalled, recovered
    stalled, recovered = _run(main())
    assert stalled is not None and "no progress" in stalled
    assert recovered is None


def test_fault_step_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("ROOFLM_FAULT_INJECT_STEP", "5")
    assert AsyncLLMEngine(FakeEngine()).fault_inject_step == 5
    monkeypatch.delenv("ROOFLM_FAULT_INJECT_STEP")
    assert AsyncLLMEngine(FakeEngine()).fault_inject_step is None
