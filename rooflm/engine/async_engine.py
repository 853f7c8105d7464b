"""The in-process front end (an EngineClient, engine/client.py): one thread owns the LLMEngine,
the event loop talks to it.

Why a thread: step() is a blocking forward pass. Run on the event loop, it would
stall every connection for its whole duration. Why one thread: LLMEngine is not
thread-safe, so every mutation (add_request, abort_request, step) must happen
in one order. The event loop sends commands through a thread-safe queue; the
engine thread applies them between steps and sends each request's outputs back
to that request's own asyncio queue (loop.call_soon_threadsafe). The event
loop never reads or writes the engine's state.

The engine thread, in a loop:
  1. take the pending commands (block briefly when there is no work): add a
     group of requests (after admission control), abort requests, stop;
  2. if there is unfinished work, run one step and hand out its outputs;
  3. publish the scheduler's state (gauges, the snapshot for logs and health).

Admission control runs on the engine thread, where the real queue is: a group
is refused (429) when the waiting queue would pass max_queued_requests or the
tokens in flight (prompt + n * max_tokens, summed over admitted requests)
would pass max_tokens_in_flight. Refusing fast beats queueing forever.

If a step raises, the engine is declared dead: every in-flight request gets an
EngineDeadError, the thread stays alive only to refuse new work, and the
on_dead callback tells the server (which reports unhealthy and exits).

Test hook: ROOFLM_FAULT_INJECT_STEP=N makes the N-th engine step raise
(serving_loop.py; counted from 1 since the engine thread started).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from rooflm.engine.client import (SLEEP_ABORT_REASON, EngineClient, NullMetrics, RequestStream,
                                  SnapshotMetrics, StepTokens, TrackedRequest, admit_group,
                                  finish_reason_of)
from rooflm.engine.outputs import RequestOutput
from rooflm.engine.report import EngineSnapshot
from rooflm.engine.request import Request, RequestStatus
from rooflm.engine.request_types import (AdmissionLimits, AdmissionRejected, EngineDeadError,
                                         GenerateRequest, RequestAborted)
from rooflm.engine.serving_loop import (EMPTY_STEP_BACKOFF_S, IDLE_TICK_S, CountedSteps,
                                        add_group, admission_check, fault_step_from_env)

logger = logging.getLogger(__name__)


# ---- commands from the event loop to the engine thread ----------------------------------------------


@dataclass
class _Add:
    requests: list[GenerateRequest]
    streams: list[RequestStream]
    future: concurrent.futures.Future
    bypass_limits: bool = False


@dataclass
class _Abort:
    request_ids: Optional[list[str]]  # None: every request
    reason: Optional[str] = None  # set: tell the waiting handler, it did not ask for this


@dataclass
class _Stop:
    pass


@dataclass
class _Sleep:
    level: Optional[int]  # None: wake up
    future: concurrent.futures.Future


class _Tracked(TrackedRequest):
    """The engine thread's bookkeeping for one admitted request: its engine Request (whose
    status says when it is first scheduled) and its reservation against the tokens in flight."""

    __slots__ = ("engine_request", "reserved_tokens")

    def __init__(self, request: GenerateRequest, stream: RequestStream, engine_request: Request):
        super().__init__(request, stream)
        self.engine_request = engine_request
        self.reserved_tokens = request.reserved_tokens


class AsyncLLMEngine(EngineClient):
    def __init__(self, engine, limits: Optional[AdmissionLimits] = None, metrics=None,
                 fault_inject_step: Optional[int] = None):
        """engine: an LLMEngine, owned by this object's thread from start() on. Step costs
        (MBU, MFU) reach the metrics through an observer the server adds to the engine.

        fault_inject_step: see serving_loop.py's test hook; None reads the environment.
        """
        self.engine = engine
        self.limits = limits or AdmissionLimits()
        self.metrics = metrics or NullMetrics()
        if fault_inject_step is None:
            fault_inject_step = fault_step_from_env()
        self._steps = CountedSteps(fault_inject_step)
        # The engine's state after the latest step, for logs and health: replaced whole by
        # the engine thread, so the event loop always reads one consistent snapshot.
        self._snapshot: EngineSnapshot = engine.snapshot()

        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._on_dead: Optional[Callable[[BaseException], None]] = None
        self._stopped = False
        # Written by the engine thread, read anywhere (single attribute loads are atomic).
        self._dead: Optional[BaseException] = None
        self._last_progress = time.monotonic()
        self._num_in_flight = 0
        self._sleeping = engine.is_sleeping
        # Engine thread only.
        self._tracked: dict[str, _Tracked] = {}
        self._tokens_in_flight = 0
        self._snapshot_metrics = SnapshotMetrics(self.metrics)

    # ---- event loop side ---------------------------------------------------------------------------

    def start(self, on_dead: Optional[Callable[[BaseException], None]] = None) -> None:
        """Start the engine thread; call from the event loop that will await results.

        on_dead(exc) is called on the event loop if a step fails.
        """
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("the engine loop is already started")
        # A stopped engine may start again (an app served twice in one process).
        self._commands = queue.SimpleQueue()
        self._stopped = False
        self._loop = asyncio.get_running_loop()
        self._on_dead = on_dead
        self._last_progress = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="rooflm-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything and end the engine thread (blocking; waits up to one step)."""
        self._stopped = True
        if self._thread is None:
            return
        self._commands.put(_Stop())
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the engine thread did not stop within %.0f s", timeout)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """stop() from the event loop, without blocking it."""
        await asyncio.to_thread(self.stop, timeout)

    async def generate(self, requests: list[GenerateRequest],
                       bypass_limits: bool = False) -> list[RequestStream]:
        self._raise_if_unavailable()

        def send(streams: list[RequestStream]) -> asyncio.Future:
            future: concurrent.futures.Future = concurrent.futures.Future()
            self._commands.put(_Add(requests, streams, future, bypass_limits))
            return asyncio.wrap_future(future)

        return await admit_group(requests, send, self.abort)

    def abort(self, request_ids: list[str], reason: Optional[str] = None) -> None:
        # Queued after any add of the same ids: the engine thread applies them in order.
        if request_ids:
            self._commands.put(_Abort(list(request_ids), reason))

    def abort_all(self, reason: str) -> None:
        self._commands.put(_Abort(None, reason))

    async def sleep(self, level: int = 1) -> None:
        await self._sleep_command(level)

    async def wake_up(self) -> Optional[dict]:
        return await self._sleep_command(None)

    async def _sleep_command(self, level: Optional[int]) -> Optional[dict]:
        self._raise_if_unavailable()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Sleep(level, future))
        return await asyncio.wrap_future(future)

    @property
    def is_sleeping(self) -> bool:
        return self._sleeping

    def health(self, stall_seconds: float) -> Optional[str]:
        """None while the engine loop is alive and making progress; else why not."""
        if self._dead is not None:
            return f"the engine failed: {type(self._dead).__name__}: {self._dead}"
        if self._thread is None or not self._thread.is_alive():
            return "the engine loop is not running"
        silent = time.monotonic() - self._last_progress
        if silent > stall_seconds:
            return f"the engine loop has made no progress for {silent:.1f} s"
        return None

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    @property
    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    @property
    def fault_inject_step(self) -> Optional[int]:
        return self._steps.fault_inject_step

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    def _raise_if_unavailable(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine failed: {type(self._dead).__name__}: {self._dead}")
        if self._stopped or self._thread is None or not self._thread.is_alive():
            raise EngineDeadError("the engine loop is not running")

    def _deliver_on_loop(self, deliveries: list[tuple[RequestStream, object]]) -> None:
        for stream, item in deliveries:
            stream.put(item)

    # ---- engine thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        backoff = False
        while True:
            try:
                commands = self._next_commands(backoff)
                for index, command in enumerate(commands):
                    if isinstance(command, _Stop):
                        self._stop_tracked()
                        self._refuse_adds(commands[index + 1:])
                        return
                    self._apply(command)
                backoff = False
                if self._dead is None and self.engine.has_unfinished_requests():
                    backoff = not self._step()
                else:
                    self._last_progress = time.monotonic()  # idle (or dead): the loop is alive
                if self._dead is None:
                    self._publish_state()
            except BaseException as exc:  # noqa: BLE001 - any failure here kills the engine
                if self._dead is None:
                    self._die(exc)
                else:
                    logger.exception("error in the stopped engine loop")

    def _stop_tracked(self) -> None:
        if self._dead is None:
            self._abort_tracked(list(self._tracked), "the server is stopping")

    def _refuse_adds(self, commands: list) -> None:
        """Nobody will apply these any more: answer every add that came after the stop."""
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for command in commands:
            if isinstance(command, (_Add, _Sleep)) and command.future.set_running_or_notify_cancel():
                command.future.set_exception(EngineDeadError("the engine loop has stopped"))

    def _next_commands(self, backoff: bool) -> list:
        commands = []
        idle = self._dead is not None or not self.engine.has_unfinished_requests()
        if idle or backoff:
            try:
                commands.append(self._commands.get(timeout=IDLE_TICK_S if idle else EMPTY_STEP_BACKOFF_S))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command) -> None:
        if isinstance(command, _Add):
            self._apply_add(command)
            return
        if isinstance(command, _Sleep):
            self._apply_sleep(command)
            return
        ids = list(self._tracked) if command.request_ids is None else command.request_ids
        self._abort_tracked(ids, command.reason)

    def _apply_add(self, command: _Add) -> None:
        future = command.future
        if not future.set_running_or_notify_cancel():
            return  # the caller gave up before we got here
        try:
            self._admit(command)
        except Exception as exc:  # noqa: BLE001 - every refusal goes back to the caller
            if not isinstance(exc, (ValueError, AdmissionRejected, EngineDeadError)):
                logger.exception("unexpected error while adding a request")
            future.set_exception(exc)
        else:
            future.set_result(None)

    def _apply_sleep(self, command: _Sleep) -> None:
        future = command.future
        if not future.set_running_or_notify_cancel():
            return
        phases = None
        try:
            if command.level is None:
                phases = self.engine.wake_up()
            else:
                self.engine.check_sleep_level(command.level)
                self._abort_tracked(list(self._tracked), SLEEP_ABORT_REASON)
                self.engine.sleep(command.level)
        except Exception as exc:  # noqa: BLE001 - the caller is told
            future.set_exception(exc)
        else:
            future.set_result(phases)
        finally:
            self._sleeping = self.engine.is_sleeping

    def _admit(self, command: _Add) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine failed: {self._dead}")
        if not command.bypass_limits:
            rejection = self._admission_check(command.requests)
            if rejection is not None:
                raise rejection
        added = add_group(self.engine, command.requests)
        for request, stream, engine_request in zip(command.requests, command.streams, added):
            self._tracked[request.request_id] = _Tracked(request, stream, engine_request)
            self._tokens_in_flight += request.reserved_tokens

    def _admission_check(self, requests: list[GenerateRequest]) -> Optional[AdmissionRejected]:
        return admission_check(self.engine, self.limits, self._tokens_in_flight, requests)

    def _abort_tracked(self, request_ids: list[str], reason: Optional[str]) -> None:
        deliveries = []
        for request_id in request_ids:
            tracked = self._tracked.get(request_id)
            if tracked is None:
                continue  # finished already, or never admitted
            self.engine.abort_request(request_id)
            self._finish(tracked, "abort", time.monotonic())
            if reason is not None:
                deliveries.append((tracked.stream, RequestAborted(reason)))
        self._deliver(deliveries)

    def _step(self) -> bool:
        """One engine step; returns whether it did any work."""
        started = time.monotonic()
        outputs, did_work = self._steps.run(self.engine)
        ended = time.monotonic()
        if did_work:
            self._last_progress = ended
            self._note_scheduled(started)
        self._deliver(self._process_outputs(outputs, ended))
        return did_work

    def _note_scheduled(self, step_start: float) -> None:
        """A request leaves the queue when a step first schedules it: that is its queue time."""
        for tracked in self._tracked.values():
            if (tracked.scheduled_time is None
                    and tracked.engine_request.status != RequestStatus.WAITING):
                tracked.scheduled_time = step_start

    def _process_outputs(self, outputs: list[RequestOutput], now: float) -> list:
        deliveries = []
        counts = StepTokens()
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            new_tokens = sum(len(ids) for ids in out.delta_token_ids)
            if new_tokens:
                tracked.tokens_arrived(new_tokens, now, self.metrics, counts)
            deliveries.append((tracked.stream, out))
            if out.finished:
                self._finish(tracked, finish_reason_of(out), now, out)
        self.metrics.add_tokens(counts.prompt, counts.generation)
        return deliveries

    def _finish(self, tracked: _Tracked, reason: str, now: float,
                out: Optional[RequestOutput] = None) -> None:
        self._tracked.pop(tracked.request.request_id, None)
        self._tokens_in_flight -= tracked.reserved_tokens
        tracked.observe_end(self.metrics, reason, now, out)

    def _die(self, exc: BaseException) -> None:
        self._dead = exc
        logger.error("the engine failed; failing %d in-flight requests", len(self._tracked),
                     exc_info=exc)
        error = EngineDeadError(f"the engine failed: {type(exc).__name__}: {exc}")
        deliveries = [(t.stream, error) for t in self._tracked.values()]
        ids = list(self._tracked)
        for tracked in self._tracked.values():
            tracked.observe_failure(self.metrics)
        self._tracked.clear()
        self._tokens_in_flight = 0
        try:
            self.engine.abort_request(ids)  # best effort: free their blocks
            self._publish_state()
        except Exception:  # noqa: BLE001 - the engine is already broken
            logger.exception("could not abort the failed requests")
        self._deliver(deliveries)
        if self._on_dead is not None:
            self._call_on_loop(self._on_dead, exc)

    def _deliver(self, deliveries: list) -> None:
        if deliveries:
            self._call_on_loop(self._deliver_on_loop, deliveries)

    def _call_on_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the event loop is closed: the process is exiting

    def _publish_state(self) -> None:
        snap = self._snapshot = self.engine.snapshot()
        self._num_in_flight = len(self._tracked)
        self._snapshot_metrics.publish(snap, self._tokens_in_flight)

