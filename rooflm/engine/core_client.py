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

Restart (RestartPolicy, `rooflm serve --engine-restart`, on by default there):
a core that dies is replaced by a fresh one of the same configuration
(EngineCoreProcess.restart) instead. What it held is sorted by what the client
has seen of it: a request that already streamed tokens fails with an
EngineDeadError saying so (its tokens cannot be taken back); one that had none
yet (queued, or in its prefill), and every group sent but not yet answered, is
sent to the new core once, as it was. New requests wait for the new core;
health() says "restarting" meanwhile. The crash-loop guard: a core that dies
max_deaths times within window_s seconds stays down, and on_dead is called as
without restart.

Admission runs in the core, where the real queue is; aborts are sent and
forgotten here at once (the core frees the blocks at its next chance).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import msgspec
import zmq
import zmq.asyncio

from rooflm.engine.client import (SLEEP_ABORT_REASON, EngineClient, NullMetrics, RequestStream, RestartPolicy,
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
    # Tracked requests sent again to a restarted core: nobody awaits the reply.
    resubmitted: bool = False


class EngineCoreClient(EngineClient):
    def __init__(self, core: EngineCoreProcess, limits: Optional[AdmissionLimits] = None,
                 metrics=None, restart: Optional[RestartPolicy] = None):
        """core: a launched EngineCoreProcess, owned by this client from start() on.
        restart: what to do when the core dies (module docstring); default: stay down."""
        self.core = core
        self.restart = restart or RestartPolicy()
        self._deaths: collections.deque[float] = collections.deque()  # within the guard's window
        self._restarting: Optional[str] = None  # why, while a new core is being started
        self._restarted: Optional[asyncio.Event] = None
        self._restart_task: Optional[asyncio.Task] = None
        self._retried: set[str] = set()  # request ids sent again once already
        self.num_restarts = 0
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
        self._start_reading()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything, let the core exit (killed after `timeout`), free the sockets."""
        self._begin_stop()
        if self._restart_task is not None and not self._restart_task.done():
            # A core being started got no Shutdown: close() sends one once it is up.
            await asyncio.wait({self._restart_task}, timeout=timeout)
            await self._stop_reading()
            await asyncio.to_thread(self.core.close, timeout)
            return
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
        if self._dead is None and self._restarting is None:
            self._send_quietly(Shutdown())

    def _start_reading(self) -> None:
        socket = zmq.asyncio.Socket.from_socket(self.core.output_socket)
        self._reader = self._loop.create_task(self._read_forever(socket), name="rooflm-core-reader")
        self._loop.add_reader(self.core.sentinel, self._on_core_exit)

    async def _stop_reading(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self.core.sentinel)
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            if self._loop is not None and not self.core.output_socket.closed:
                # zmq.asyncio watches the socket's descriptor until its wrapper is closed, which
                # the core's own close() skips: a restarted core's socket may get the same
                # number, and the stale watch would hide it from the new reader.
                self._loop.remove_reader(self.core.output_socket.FD)

    # ---- requests ------------------------------------------------------------------------------------

    async def generate(self, requests: list[GenerateRequest],
                       bypass_limits: bool = False) -> list[RequestStream]:
        if self._restarting is not None:
            await self._restarted.wait()  # the new core takes it; or it stayed down (raised below)
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

    async def wake_up(self) -> Optional[dict]:
        return await self._sleep_call(None)

    async def _sleep_call(self, level: Optional[int]) -> Optional[dict]:
        self._raise_if_unavailable()
        call_id = next(self._batch_ids)
        future = self._loop.create_future()
        self._sleep_calls[call_id] = (future, level)
        self._send(Sleep(call_id, level))
        return await future

    @property
    def is_sleeping(self) -> bool:
        return self._sleeping

    def health(self, stall_seconds: float) -> Optional[str]:
        """None while the engine core is alive and making progress; else why not."""
        if self._dead is not None:
            return f"the engine failed: {self._dead}"
        if self._restarting is not None:
            return f"the engine core is restarting after it failed: {self._restarting}"
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
    def is_restarting(self) -> bool:
        return self._restarting is not None

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
            self.core.input_socket.send(self.core.frames.seal(self._encode(message)), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise EngineDeadError(f"cannot reach the engine core: {exc}") from None

    def _send_quietly(self, message) -> None:
        """For aborts: a core that cannot be reached holds nothing to free."""
        if self._restarting is not None:
            return  # the dead core held it; the new one never will
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
            frame = self.core.frames.open(frame)
            if frame is None:
                continue  # not from the core: dropped and counted (frame_auth.py)
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
        if pending is not None and pending.resubmitted:
            self._on_resubmit_reply(pending, reply)
            return
        if pending is None or pending.future.done():
            return  # the caller gave up (cancelled): its abort is on its way to the core
        if reply.error is not None:
            self._retried.difference_update(r.request_id for r in pending.requests)
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
            future.set_result(reply.wake_phases)

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
        self._retried.discard(tracked.request.request_id)
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
            if pending.resubmitted:
                pending.future.cancel()  # nobody awaits it: its requests' streams are told
            elif not pending.future.done():
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
            self._loop.call_later(EXIT_REPORT_GRACE_S, self._report_exit, self.core.process)

    def _report_exit(self, process) -> None:
        # A restart may have replaced the process meanwhile: its death was handled already.
        if not self._stopped and self._dead is None and process is self.core.process:
            self._die(f"the engine core process exited with code {process.exitcode}", None)

    def _die(self, error: str, state: Optional[CoreState]) -> None:
        """The core failed: restart it (RestartPolicy), or fail everything for good."""
        if self._dead is not None or self._restarting is not None:
            return
        if not self.restart.enabled or self._stopped:
            self._fail_for_good(error, state)
            return
        now = time.monotonic()
        self._deaths.append(now)
        while now - self._deaths[0] > self.restart.window_s:
            self._deaths.popleft()
        if len(self._deaths) >= self.restart.max_deaths:
            self._fail_for_good(f"{error}; it died {len(self._deaths)} times within "
                                f"{self.restart.window_s:g} s, so it stays down (crash-loop guard)",
                                state)
            return
        self._begin_restart(error)

    def _fail_for_good(self, error: str, state: Optional[CoreState]) -> None:
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


    # ---- restart -------------------------------------------------------------------------------------

    def _begin_restart(self, error: str) -> None:
        self._restarting = error
        self._restarted = asyncio.Event()
        lost = EngineDeadError(f"the engine failed: {error}; this request had produced tokens, "
                               f"which cannot be taken back: retry it (the engine core is restarting)")
        kept = failed = 0
        for request_id, tracked in list(self._tracked.items()):
            if tracked.first_token_time is None and request_id not in self._retried:
                kept += 1
                continue  # nothing streamed yet: the new core runs it from the start
            failed += 1
            self._fail_tracked(tracked, lost)
        for future, _ in self._sleep_calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(f"the engine failed: {error}"))
        self._sleep_calls.clear()
        logger.error("the engine core failed (%s); restarting it: %d requests failed (they had "
                     "streamed tokens), %d kept for the new core, %d groups to send again", error,
                     failed, kept, len(self._adds))
        self._restart_task = self._loop.create_task(self._restart_core(error),
                                                    name="rooflm-core-restart")

    async def _restart_core(self, error: str) -> None:
        await self._stop_reading()
        started = time.monotonic()
        try:
            await asyncio.to_thread(self.core.restart)
        except Exception as exc:  # noqa: BLE001 - EngineStartError or worse: the engine stays down
            self._restarting = None
            if not self._stopped:
                self._fail_for_good(f"{error}; restarting the engine core failed: {exc}", None)
            self._restarted.set()
            return
        if self._stopped:
            self._restarted.set()
            return  # shutdown() closes the new core
        self.num_restarts += 1
        self._restarting = None
        self._sleeping = self.core.ready_state.snapshot.is_sleeping  # a new core starts awake
        self._last_progress = time.monotonic()
        self._publish(self.core.ready_state)
        self._send(Configure(self.limits.max_queued_requests, self.limits.max_tokens_in_flight,
                             self.limits.ttft_slo_ms))
        self._start_reading()
        self._resubmit()
        logger.warning("engine core back after %.1f s (restart %d)", time.monotonic() - started,
                       self.num_restarts)
        self._restarted.set()

    def _resubmit(self) -> None:
        """Send the new core what the dead one held that had produced nothing, once each."""
        for batch_id, pending in list(self._adds.items()):
            if pending.future.done():
                del self._adds[batch_id]  # its caller gave up
                continue
            ids = [r.request_id for r in pending.requests]
            if any(request_id in self._retried for request_id in ids):
                del self._adds[batch_id]
                self._retried.difference_update(ids)
                pending.future.set_exception(EngineDeadError(
                    "the engine core died twice while this request waited to be admitted"))
                continue
            self._retried.update(ids)
            # Limits were checked when it was first sent; the new core's queue is empty.
            self._send(AddRequests(batch_id, pending.requests, True))
        kept = list(self._tracked.values())
        if kept:
            requests = [tracked.request for tracked in kept]
            self._retried.update(r.request_id for r in requests)
            batch_id = next(self._batch_ids)
            self._adds[batch_id] = _PendingAdd(self._loop.create_future(), requests,
                                               [t.stream for t in kept], resubmitted=True)
            self._send(AddRequests(batch_id, requests, True))

    def _on_resubmit_reply(self, pending: _PendingAdd, reply: AddReply) -> None:
        pending.future.set_result(None)  # nobody awaits it
        if reply.error is None:
            return
        error = EngineDeadError(f"the restarted engine core refused a request it was sent again: "
                                f"{reply.error.message}")
        for request in pending.requests:
            tracked = self._tracked.get(request.request_id)
            if tracked is not None:
                self._fail_tracked(tracked, error)

    def _fail_tracked(self, tracked: _Tracked, error: EngineDeadError) -> None:
        """One request ends in error while the engine lives on (a router's load is released)."""
        self._tracked.pop(tracked.request.request_id, None)
        self._retried.discard(tracked.request.request_id)
        if self.on_request_done is not None:
            self.on_request_done(tracked.request)
        tracked.observe_failure(self.metrics)
        tracked.stream.put(error)


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

