"""The front end of the engine-core process: an EngineClient (engine/client.py) over ZMQ.

The engine runs in its own process (core.py), reached through an
EngineCoreProcess (core_process.py). The event loop never blocks on it: sends
never wait (unbounded queue), and one asyncio task reads the core's messages.

Per message from the core:
  AddReply     resolves the generate() call that sent the group: its requests
               are tracked from here on, or the reply's error is raised there
               (InvalidRequest 400, AdmissionRejected 429, ...);
  StepOutputs  one per engine step: each request's news is added to what it
               has so far and handed to its stream as a RequestOutput (the
               cumulative text, ids and logprobs plus this step's deltas, as
               LLMEngine.step() returns them); the step's StepReports go to the
               observers; the latency metrics are taken here, when the tokens
               reach the process that streams them;
  Heartbeat    the core's state: the gauges, the snapshot, the last progress;
  EngineDead   every in-flight request gets EngineDeadError, on_dead is called.
A core that exits without EngineDead (killed, crashed) is noticed through its
process sentinel and treated the same way.

Admission runs in the core, where the real queue is; aborts are sent and
forgotten here at once (the core frees the blocks at its next chance).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import msgspec
import zmq
import zmq.asyncio

from rooflm.engine.client import (SLEEP_ABORT_REASON, EngineClient, NullMetrics, RequestStream,
                                  SnapshotMetrics, StepTokens, TrackedRequest, admit_group,
                                  finish_reason_of)
from rooflm.engine.core_process import EngineCoreProcess
from rooflm.engine.core_protocol import (Abort, AddError, AddReply, AddRequests, Configure,
                                         CoreState, EngineDead, Heartbeat, RequestDelta, Shutdown,
                                         Sleep, SleepReply, StepOutputs, encoder, output_decoder)
from rooflm.engine.outputs import CompletionOutput, RequestOutput
from rooflm.engine.report import EngineSnapshot
from rooflm.engine.request_types import (AdmissionLimits, AdmissionRejected, EngineDeadError,
                                         GenerateRequest, RequestAborted)
from rooflm.errors import InvalidRequest

logger = logging.getLogger(__name__)

# After the core's process exits, how long its last messages (EngineDead and its
# error) get to arrive before the exit itself is reported as the failure.
EXIT_REPORT_GRACE_S = 0.5


@dataclass
class _Sample:
    """One of a request's n samples so far: what CompletionOutput shows."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: Optional[list] = None
    finish_reason: Optional[str] = None
    stop_reason: object = None


class _Tracked(TrackedRequest):
    """An admitted request: its stream, and its outputs rebuilt from the core's deltas."""

    __slots__ = ("samples", "prompt_logprobs")

    def __init__(self, request: GenerateRequest, stream: RequestStream):
        super().__init__(request, stream)
        self.samples: dict[int, _Sample] = {}
        self.prompt_logprobs = None

    def apply(self, delta: RequestDelta) -> RequestOutput:
        """Add one step's news; the RequestOutput LLMEngine.step() would have returned."""
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        new: dict[int, tuple[list[int], str]] = {}
        for sample_delta in delta.samples:
            sample = self._sample(sample_delta.index)
            sample.token_ids.extend(sample_delta.token_ids)
            sample.text += sample_delta.text
            if sample.logprobs is not None and sample_delta.logprobs:
                sample.logprobs.extend(sample_delta.logprobs)
            sample.finish_reason = sample_delta.finish_reason
            sample.stop_reason = sample_delta.stop_reason
            new[sample_delta.index] = (sample_delta.token_ids, sample_delta.text)
        outputs, delta_ids, delta_text = [], [], []
        for index in sorted(self.samples):
            sample = self.samples[index]
            # The live lists, not copies, as the engine hands them out: copying every step
            # would cost O(length^2).
            outputs.append(CompletionOutput(index, sample.text, sample.token_ids, sample.logprobs,
                                            sample.finish_reason, sample.stop_reason))
            ids, text = new.get(index, ([], ""))
            delta_ids.append(ids)
            delta_text.append(text)
        return RequestOutput(self.request.request_id, None, self.request.prompt_token_ids, outputs,
                             delta.finished, self.prompt_logprobs, delta.num_cached_tokens,
                             delta_text, delta_ids)

    def _sample(self, index: int) -> _Sample:
        sample = self.samples.get(index)
        if sample is None:
            sample = self.samples[index] = _Sample(index)
            if self.request.params.logprobs is not None:
                sample.logprobs = []
        return sample


@dataclass
class _PendingAdd:
    """A group sent to the core, until its AddReply."""

    future: asyncio.Future
    requests: list[GenerateRequest]
    streams: list[RequestStream]
    abort_reason: Optional[str] = None  # abort_all came first: abort it as soon as it is in


class EngineCoreClient(EngineClient):
    def __init__(self, core: EngineCoreProcess, limits: Optional[AdmissionLimits] = None,
                 metrics=None):
        """core: a launched EngineCoreProcess, owned by this client from start() on."""
        self.core = core
        self.limits = limits or AdmissionLimits()
        self.metrics = metrics or NullMetrics()
        self._snapshot: EngineSnapshot = core.ready_state.snapshot
        self._encode = encoder().encode
        self._tracked: dict[str, _Tracked] = {}
        self._adds: dict[int, _PendingAdd] = {}
        # Sleep calls sent, until their SleepReply: call id -> (future, level; None: wake up).
        self._sleep_calls: dict[int, tuple[asyncio.Future, Optional[int]]] = {}
        self._sleeping = self._snapshot.is_sleeping
        self._batch_ids = itertools.count()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._reader: Optional[asyncio.Task] = None
        self._on_dead: Optional[Callable[[BaseException], None]] = None
        self._started = False
        self._stopped = False
        self._dead: Optional[str] = None  # the core's error, once it failed
        self._last_progress = time.monotonic()
        self._snapshot_metrics = SnapshotMetrics(self.metrics)
        # Called with each admitted request as it finishes or is aborted (a router's load).
        self.on_request_done: Optional[Callable[[GenerateRequest], None]] = None

    # ---- lifecycle -----------------------------------------------------------------------------------

    def start(self, on_dead: Optional[Callable[[BaseException], None]] = None) -> None:
        """Start reading the core's messages (call on the event loop)."""
        if self._started:
            raise RuntimeError("the engine core client is already started; a stopped core "
                               "cannot start again")
        self._started = True
        self._loop = asyncio.get_running_loop()
        self._on_dead = on_dead
        self._last_progress = time.monotonic()
        self._send(Configure(self.limits.max_queued_requests, self.limits.max_tokens_in_flight,
                             self.limits.ttft_slo_ms))
        self._publish(self.core.ready_state)
        socket = zmq.asyncio.Socket.from_socket(self.core.output_socket)
        self._reader = self._loop.create_task(self._read_forever(socket), name="rooflm-core-reader")
        self._loop.add_reader(self.core.sentinel, self._on_core_exit)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything, let the core exit (killed after `timeout`), free the sockets."""
        self._begin_stop()
        await asyncio.to_thread(self.core.join, timeout)
        await self._stop_reading()
        self.core.close(timeout=0)  # it had its time: kill it if it is still there

    def stop(self, timeout: float = 10.0) -> None:
        """shutdown(), blocking: call it on the event loop's thread, or with no loop running."""
        self._begin_stop()
        if self._reader is not None:
            self._reader.cancel()
        self.core.close(timeout)

    def _begin_stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._abort_tracked(list(self._tracked), "the server is stopping")
        self._fail_adds(EngineDeadError("the engine loop has stopped"))
        if self._dead is None:
            self._send_quietly(Shutdown())

    async def _stop_reading(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self.core.sentinel)
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)

    # ---- requests ------------------------------------------------------------------------------------

    async def generate(self, requests: list[GenerateRequest],
                       bypass_limits: bool = False) -> list[RequestStream]:
        self._raise_if_unavailable()

        def send(streams: list[RequestStream]) -> asyncio.Future:
            batch_id = next(self._batch_ids)
            pending = _PendingAdd(self._loop.create_future(), list(requests), streams)
            self._adds[batch_id] = pending
            self._send(AddRequests(batch_id, list(requests), bypass_limits))
            return pending.future

        return await admit_group(requests, send, self.abort)

    def abort(self, request_ids: list[str], reason: Optional[str] = None) -> None:
        # Forgotten here at once; the core frees the blocks when the Abort reaches it.
        if request_ids:
            self._abort_tracked(list(request_ids), reason)
            self._send_quietly(Abort(list(request_ids)))

    def abort_all(self, reason: str) -> None:
        self._abort_tracked(list(self._tracked), reason)
        for pending in self._adds.values():
            pending.abort_reason = reason
        self._send_quietly(Abort(None))

    async def sleep(self, level: int = 1) -> None:
        await self._sleep_call(level)

    async def wake_up(self) -> None:
        await self._sleep_call(None)

    async def _sleep_call(self, level: Optional[int]) -> None:
        self._raise_if_unavailable()
        call_id = next(self._batch_ids)
        future = self._loop.create_future()
        self._sleep_calls[call_id] = (future, level)
        self._send(Sleep(call_id, level))
        await future

    @property
    def is_sleeping(self) -> bool:
        return self._sleeping

    def health(self, stall_seconds: float) -> Optional[str]:
        """None while the engine core is alive and making progress; else why not."""
        if self._dead is not None:
            return f"the engine failed: {self._dead}"
        if not self._started or self._stopped:
            return "the engine loop is not running"
        # The core's own clock reading: monotonic time is one clock for the whole host.
        silent = time.monotonic() - self._last_progress
        if silent > stall_seconds:
            return f"the engine loop has made no progress for {silent:.1f} s"
        return None

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    @property
    def num_in_flight(self) -> int:
        return len(self._tracked)

    @property
    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    def _raise_if_unavailable(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine failed: {self._dead}")
        if self._stopped or not self._started:
            raise EngineDeadError("the engine loop is not running")

    def _send(self, message) -> None:
        try:
            self.core.input_socket.send(self._encode(message), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise EngineDeadError(f"cannot reach the engine core: {exc}") from None

    def _send_quietly(self, message) -> None:
        """For aborts: a core that cannot be reached holds nothing to free."""
        try:
            self._send(message)
        except EngineDeadError:
            pass

    # ---- the core's messages ------------------------------------------------------------------------

    async def _read_forever(self, socket: zmq.asyncio.Socket) -> None:
        decode = output_decoder().decode
        while True:
            try:
                frame = await socket.recv()
            except zmq.ZMQError:
                if self._stopped:
                    return  # the socket was closed under us by a blocking stop()
                raise
            try:
                message = decode(frame)
            except msgspec.DecodeError as exc:
                logger.error("dropped an undecodable message from the engine core (%d bytes): %s",
                             len(frame), exc)
                continue
            try:
                self._dispatch(message)
            except Exception as exc:  # noqa: BLE001 - a request must fail, never wait forever
                logger.exception("error while handling the engine core's message")
                self._die(f"the API process could not handle the engine's output: "
                          f"{type(exc).__name__}: {exc}", None)
                return

    def _dispatch(self, message) -> None:
        if isinstance(message, StepOutputs):
            self._on_step(message)
        elif isinstance(message, AddReply):
            self._on_add_reply(message)
        elif isinstance(message, SleepReply):
            self._on_sleep_reply(message)
        elif isinstance(message, Heartbeat):
            self._publish(message.state)
        elif isinstance(message, EngineDead):
            self._die(message.error, message.state)

    def _on_add_reply(self, reply: AddReply) -> None:
        pending = self._adds.pop(reply.batch_id, None)
        if pending is None or pending.future.done():
            return  # the caller gave up (cancelled): its abort is on its way to the core
        if reply.error is not None:
            pending.future.set_exception(_add_error(reply.error))
            return
        for request, stream in zip(pending.requests, pending.streams):
            self._tracked[request.request_id] = _Tracked(request, stream)
        if pending.abort_reason is not None:
            self._abort_tracked([r.request_id for r in pending.requests], pending.abort_reason)
        pending.future.set_result(None)

    def _on_sleep_reply(self, reply: SleepReply) -> None:
        self._sleeping = reply.is_sleeping
        future, level = self._sleep_calls.pop(reply.call_id, (None, None))
        if reply.error is None and level is not None:
            # The core aborted every request it had before it slept (groups admitted before
            # the Sleep included): their streams are told now.
            self._abort_tracked(list(self._tracked), SLEEP_ABORT_REASON)
        if future is None or future.done():
            return
        if reply.error is not None:
            future.set_exception(_add_error(reply.error))
        else:
            future.set_result(None)

    def _on_step(self, message: StepOutputs) -> None:
        now = time.monotonic()
        counts = StepTokens()
        for delta in message.outputs:
            tracked = self._tracked.get(delta.request_id)
            if tracked is None:
                continue  # aborted here while the core ran its step
            out = tracked.apply(delta)
            new_tokens = sum(len(sample.token_ids) for sample in delta.samples)
            if new_tokens:
                tracked.tokens_arrived(new_tokens, now, self.metrics, counts)
            tracked.stream.put(out)
            if delta.finished:
                if delta.queued_s is not None:
                    # When the core first scheduled it: one monotonic clock for the host.
                    tracked.scheduled_time = tracked.request.arrival_time + delta.queued_s
                self._finish(tracked, finish_reason_of(out), now, out)
        self.metrics.add_tokens(counts.prompt, counts.generation)
        for report in message.reports:
            for observer in self.core.observers:
                observer(report)
        self._publish(message.state)

    def _finish(self, tracked: _Tracked, reason: str, now: float,
                out: Optional[RequestOutput] = None) -> None:
        self._tracked.pop(tracked.request.request_id, None)
        if self.on_request_done is not None:
            self.on_request_done(tracked.request)
        tracked.observe_end(self.metrics, reason, now, out)

    def _abort_tracked(self, request_ids: list[str], reason: Optional[str]) -> None:
        now = time.monotonic()
        for request_id in request_ids:
            tracked = self._tracked.get(request_id)
            if tracked is None:
                continue  # finished already, or never admitted
            self._finish(tracked, "abort", now)
            if reason is not None:
                tracked.stream.put(RequestAborted(reason))

    def _fail_adds(self, error: BaseException) -> None:
        for pending in self._adds.values():
            if not pending.future.done():
                pending.future.set_exception(error)
        self._adds.clear()
        for future, _ in self._sleep_calls.values():
            if not future.done():
                future.set_exception(error)
        self._sleep_calls.clear()

    def _publish(self, state: CoreState) -> None:
        self._snapshot = state.snapshot
        self._last_progress = state.last_progress
        self._snapshot_metrics.publish(state.snapshot, state.tokens_in_flight)

    # ---- failure -------------------------------------------------------------------------------------

    def _on_core_exit(self) -> None:
        self._loop.remove_reader(self.core.sentinel)
        if not self._stopped and self._dead is None:
            self._loop.call_later(EXIT_REPORT_GRACE_S, self._report_exit)

    def _report_exit(self) -> None:
        if not self._stopped and self._dead is None:
            self._die(f"the engine core process exited with code {self.core.exitcode}", None)

    def _die(self, error: str, state: Optional[CoreState]) -> None:
        if self._dead is not None:
            return
        self._dead = error
        logger.error("the engine failed (%s); failing %d in-flight requests", error,
                     len(self._tracked))
        exc = EngineDeadError(f"the engine failed: {error}")
        for tracked in self._tracked.values():
            tracked.observe_failure(self.metrics)
            tracked.stream.put(exc)
        self._tracked.clear()
        self._fail_adds(exc)
        if state is not None:
            self._publish(state)
        if self._on_dead is not None:
            self._on_dead(exc)


def _add_error(error: AddError) -> Exception:
    """The exception generate() raises for a refused group, as the other front ends raise it."""
    if error.kind == "invalid":
        return InvalidRequest(error.message, param=error.param)
    if error.kind == "busy":
        return AdmissionRejected(error.message, status=error.status, retry_after_s=error.retry_after_s,
                                 code=error.code)
    if error.kind == "value":
        return ValueError(error.message)
    return RuntimeError(error.message)

