"""The asyncio face of LLMEngine: one thread owns the engine, the event loop talks to it.

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

Test hook: the environment variable ROOFLM_FAULT_INJECT_STEP=N makes the N-th
call to engine.step() (counted from 1 since the engine thread started, the
server's warm-up generation included) raise RuntimeError instead of running.
It exists so tests can check the failure path; never set it in production.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Union


import rooflm.envs as envs
from rooflm.engine.outputs import RequestOutput, merge_outputs
from rooflm.engine.report import EngineSnapshot
from rooflm.engine.request import Request, RequestStatus
from rooflm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

FAULT_INJECT_ENV = "ROOFLM_FAULT_INJECT_STEP"

# How long the idle engine thread waits for a command before it checks in
# (updates its heartbeat). Small enough for a fresh health signal, large
# enough to cost nothing.
IDLE_TICK_S = 0.25

# When the scheduler has work but schedules nothing (every waiting request is
# blocked on KV blocks), back off this long instead of spinning a core.
EMPTY_STEP_BACKOFF_S = 0.01


class EngineDeadError(RuntimeError):
    """The engine loop failed; no request can make progress any more."""


class AdmissionRejected(Exception):
    """The server is too busy (429) or not taking work (503); retry later."""

    def __init__(self, message: str, status: int = 429, retry_after_s: int = 1):
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


class RequestAborted(Exception):
    """The server aborted the request (shutdown, stop) while someone waited on it."""


@dataclass
class AdmissionLimits:
    max_queued_requests: int = 64
    max_tokens_in_flight: int = 0  # 0: no cap


@dataclass
class GenerateRequest:
    """One prompt to generate for; params.max_tokens must already be resolved."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: Optional[str] = None
    arrival_time: float = field(default_factory=time.monotonic)
    record_metrics: bool = True  # False for the server's own warm-up

    @property
    def reserved_tokens(self) -> int:
        """The most tokens this request can put in the KV cache."""
        return len(self.prompt_token_ids) + self.params.n * (self.params.max_tokens or 0)


class RequestStream:
    """The outputs of one engine request, in order, as the event loop sees them.

    Items are RequestOutputs; an exception item (engine death, server-side
    abort) ends the stream and is raised by next(). A reader that falls behind
    gets what piled up since its last read merged into one output.
    """

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.finished = False
        self._queue: asyncio.Queue = asyncio.Queue()
        self._held: Optional[BaseException] = None  # met while merging: raised by the next read

    def put(self, item: Union[RequestOutput, BaseException]) -> None:
        self._queue.put_nowait(item)

    async def next(self, timeout: Optional[float] = None) -> RequestOutput:
        """The next output (several steps' worth if they are waiting); raises TimeoutError
        after `timeout` seconds."""
        if self._held is not None:
            item, self._held = self._held, None
        elif timeout is None:
            item = await self._queue.get()
        else:
            item = await asyncio.wait_for(self._queue.get(), max(timeout, 0.0))
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        item = self._merge_waiting(item)
        if item.finished:
            self.finished = True
        return item

    def _merge_waiting(self, item: RequestOutput) -> RequestOutput:
        while not item.finished and not self._queue.empty():
            later = self._queue.get_nowait()
            if isinstance(later, BaseException):
                self._held = later  # the outputs before it are delivered first
                break
            item = merge_outputs(item, later)
        return item


class NullMetrics:
    """The metrics interface the engine thread writes to; records nothing."""

    def set_scheduler_state(self, running, waiting, kv_usage, free_blocks, num_blocks): pass
    def set_tokens_in_flight(self, tokens): pass
    def add_prefix_cache(self, queries, hits): pass
    def add_preemptions(self, count): pass
    def add_tokens(self, prompt_tokens, generation_tokens): pass
    def observe_first_token(self, ttft_seconds): pass
    def observe_inter_token(self, seconds): pass
    def observe_finished(self, reason, e2e_seconds, queue_seconds): pass
    def observe_request(self, prompt_tokens, sample_tokens, prefill_seconds, decode_seconds): pass


class SnapshotMetrics:
    """The engine's state as metrics: gauges set from each snapshot, counters advanced by what
    changed since the previous one. Shared by the engine thread and the engine-core client."""

    def __init__(self, metrics):
        self.metrics = metrics
        self._seen_prefix = (0, 0)
        self._seen_preemptions = 0
        self._seen_spec = None  # the last SpecSnapshot published

    def publish(self, snap: EngineSnapshot, tokens_in_flight: int) -> None:
        metrics = self.metrics
        metrics.set_scheduler_state(snap.num_running_reqs, snap.num_waiting_reqs + snap.num_swapped_reqs,
                                    snap.kv_usage, snap.num_free_blocks, snap.num_blocks)
        metrics.set_tokens_in_flight(tokens_in_flight)
        queries, hits = self._seen_prefix
        metrics.add_prefix_cache(snap.prefix_queried_tokens - queries, snap.prefix_hit_tokens - hits)
        self._seen_prefix = (snap.prefix_queried_tokens, snap.prefix_hit_tokens)
        metrics.add_preemptions(snap.num_preemptions - self._seen_preemptions)
        self._seen_preemptions = snap.num_preemptions
        if snap.spec is not None:
            self._publish_spec(snap.spec)

    def _publish_spec(self, spec) -> None:
        seen = self._seen_spec
        if seen is None:
            per_pos = list(spec.accepted_per_pos)
            delta = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens, spec.draft_s,
                     spec.verify_s)
        else:
            per_pos = [a - b for a, b in zip(spec.accepted_per_pos, seen.accepted_per_pos)]
            delta = (spec.num_drafts - seen.num_drafts, spec.num_draft_tokens - seen.num_draft_tokens,
                     spec.num_accepted_tokens - seen.num_accepted_tokens, spec.draft_s - seen.draft_s,
                     spec.verify_s - seen.verify_s)
        drafts, draft_tokens, accepted, draft_s, verify_s = delta
        self.metrics.add_spec_decode(drafts, draft_tokens, accepted, per_pos, draft_s, verify_s)
        self._seen_spec = spec


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
class _Tracked:
    """The engine thread's bookkeeping for one admitted request."""

    request: Request
    stream: RequestStream
    reserved_tokens: int
    arrival_time: float
    record_metrics: bool
    scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None


def request_phases(scheduled: Optional[float], first_token: Optional[float],
                   last_token: Optional[float]) -> tuple[Optional[float], Optional[float]]:
    """(prefill, decode) seconds as vLLM defines them: first scheduled to first token, first
    token to last; None where a timestamp is missing (never scheduled, no token)."""
    if first_token is None:
        return None, None
    prefill = None if scheduled is None else first_token - scheduled
    return prefill, (last_token or first_token) - first_token


def admission_check(engine, limits: AdmissionLimits, tokens_in_flight: int,
                    requests: list[GenerateRequest]) -> Optional[AdmissionRejected]:
    """Why a group of requests may not be admitted now (None: it may). Runs where the engine
    is (its thread, or the engine-core process), against the live queue."""
    # The live queue, not a published snapshot: requests admitted earlier in this same
    # batch of commands are waiting already.
    waiting = engine.snapshot().num_waiting_reqs
    limit = limits.max_queued_requests
    if waiting + len(requests) > limit:
        return AdmissionRejected(f"the server is overloaded: {waiting} requests are waiting "
                                 f"(limit {limit}); retry later")
    cap = limits.max_tokens_in_flight
    reserved = sum(r.reserved_tokens for r in requests)
    if cap and tokens_in_flight + reserved > cap:
        return AdmissionRejected(f"the server is overloaded: {tokens_in_flight} tokens in "
                                 f"flight plus this request's {reserved} would pass the limit of "
                                 f"{cap}; retry later")
    return None


def add_group(engine, requests: list[GenerateRequest]) -> list[Request]:
    """Add a group of requests to the engine all or nothing: a group with one bad prompt queues
    none of its prompts (the error propagates). Used where the engine is: its thread, or the
    engine-core process."""
    added: list[Request] = []
    try:
        for request in requests:
            added.append(engine.add_request(
                request.request_id, request.prompt_token_ids, request.params,
                arrival_time=request.arrival_time, cache_salt=request.cache_salt))
    except Exception:
        if added:
            engine.abort_request([r.request_id for r in added])
        raise
    return added


def fault_step_from_env() -> Optional[int]:
    step = envs.get(FAULT_INJECT_ENV)
    if step is None:
        return None
    logger.warning("%s=%d: engine step %d will raise (test hook)", FAULT_INJECT_ENV, step, step)
    return step


class AsyncLLMEngine:
    def __init__(self, engine, limits: Optional[AdmissionLimits] = None, metrics=None,
                 fault_inject_step: Optional[int] = None):
        """engine: an LLMEngine, owned by this object's thread from start() on. Step costs
        (MBU, MFU) reach the metrics through an observer the server adds to the engine.

        fault_inject_step: see the module docstring; None reads the environment.
        """
        self.engine = engine
        self.limits = limits or AdmissionLimits()
        self.metrics = metrics or NullMetrics()
        if fault_inject_step is None:
            fault_inject_step = fault_step_from_env()
        self.fault_inject_step = fault_inject_step
        # The engine's state after the latest step, for logs and health: replaced whole by
        # the engine thread, so the event loop always reads one consistent snapshot.
        self.snapshot: EngineSnapshot = engine.snapshot()

        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._on_dead: Optional[Callable[[BaseException], None]] = None
        self._stopped = False
        # Written by the engine thread, read anywhere (single attribute loads are atomic).
        self._dead: Optional[BaseException] = None
        self._last_progress = time.monotonic()
        self._num_in_flight = 0
        # Engine thread only.
        self._tracked: dict[str, _Tracked] = {}
        self._tokens_in_flight = 0
        self._num_step_calls = 0
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
        """Admit a group of requests all together, or none of them.

        Raises AdmissionRejected (busy), ValueError (the engine refused an input;
        nothing was queued), EngineDeadError. Returns one stream per request.
        """
        self._raise_if_unavailable()
        streams = [RequestStream(r.request_id) for r in requests]
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Add(requests, streams, future, bypass_limits))
        try:
            await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # The add may still happen (it is queued); the abort queued after it undoes it.
            self.abort([r.request_id for r in requests])
            raise
        return streams

    def abort(self, request_ids: list[str], reason: Optional[str] = None) -> None:
        """Abort requests at the engine's next chance; frees their blocks. Never blocks.

        Without a reason nobody is told (the caller is gone); with one, each
        request's stream raises RequestAborted(reason).
        """
        if request_ids:
            self._commands.put(_Abort(list(request_ids), reason))

    def abort_all(self, reason: str) -> None:
        self._commands.put(_Abort(None, reason))

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
    def num_in_flight(self) -> int:
        """Requests admitted and not yet finished or aborted."""
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
            if isinstance(command, _Add) and command.future.set_running_or_notify_cancel():
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

    def _admit(self, command: _Add) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine failed: {self._dead}")
        if not command.bypass_limits:
            rejection = self._admission_check(command.requests)
            if rejection is not None:
                raise rejection
        added = add_group(self.engine, command.requests)
        for request, stream, engine_request in zip(command.requests, command.streams, added):
            self._tracked[request.request_id] = _Tracked(
                engine_request, stream, request.reserved_tokens, request.arrival_time,
                request.record_metrics)
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
        self._num_step_calls += 1
        if self.fault_inject_step is not None and self._num_step_calls == self.fault_inject_step:
            raise RuntimeError(f"fault injected at engine step {self._num_step_calls} "
                               f"({FAULT_INJECT_ENV})")
        steps_before = self.engine.num_steps
        started = time.monotonic()
        outputs = self.engine.step()
        ended = time.monotonic()
        did_work = self.engine.num_steps != steps_before
        if did_work:
            self._last_progress = ended
            self._note_scheduled(started)
        self._deliver(self._process_outputs(outputs, ended))
        return did_work

    def _note_scheduled(self, step_start: float) -> None:
        """A request leaves the queue when a step first schedules it: that is its queue time."""
        for tracked in self._tracked.values():
            if tracked.scheduled_time is None and tracked.request.status != RequestStatus.WAITING:
                tracked.scheduled_time = step_start

    def _process_outputs(self, outputs: list[RequestOutput], now: float) -> list:
        deliveries = []
        prompt_tokens = generation_tokens = 0
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            new_tokens = sum(len(ids) for ids in out.delta_token_ids)
            if new_tokens and tracked.record_metrics:
                if tracked.first_token_time is None:
                    self.metrics.observe_first_token(now - tracked.arrival_time)
                    prompt_tokens += len(out.prompt_token_ids)
                else:
                    self.metrics.observe_inter_token(now - tracked.last_token_time)
                generation_tokens += new_tokens
            if new_tokens:
                tracked.first_token_time = tracked.first_token_time or now
                tracked.last_token_time = now
            deliveries.append((tracked.stream, out))
            if out.finished:
                self._finish(tracked, finish_reason_of(out), now, out)
        self.metrics.add_tokens(prompt_tokens, generation_tokens)
        return deliveries

    def _finish(self, tracked: _Tracked, reason: str, now: float,
                out: Optional[RequestOutput] = None) -> None:
        self._tracked.pop(tracked.request.request_id, None)
        self._tokens_in_flight -= tracked.reserved_tokens
        if not tracked.record_metrics:
            return
        e2e = queued = None
        if reason != "abort":
            e2e = now - tracked.arrival_time
            if tracked.scheduled_time is not None:
                queued = tracked.scheduled_time - tracked.arrival_time
            prefill, decode = request_phases(tracked.scheduled_time, tracked.first_token_time,
                                             tracked.last_token_time)
            if out is not None:
                self.metrics.observe_request(len(out.prompt_token_ids),
                                             [len(s.token_ids) for s in out.outputs],
                                             prefill, decode)
        self.metrics.observe_finished(reason, e2e, queued)

    def _die(self, exc: BaseException) -> None:
        self._dead = exc
        logger.error("the engine failed; failing %d in-flight requests", len(self._tracked),
                     exc_info=exc)
        error = EngineDeadError(f"the engine failed: {type(exc).__name__}: {exc}")
        deliveries = [(t.stream, error) for t in self._tracked.values()]
        ids = list(self._tracked)
        for tracked in self._tracked.values():
            if tracked.record_metrics:
                self.metrics.observe_finished("error", None, None)
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
        snap = self.snapshot = self.engine.snapshot()
        self._num_in_flight = len(self._tracked)
        self._snapshot_metrics.publish(snap, self._tokens_in_flight)


def finish_reason_of(out: RequestOutput) -> str:
    """One reason per request: "length" if any sample ran out of tokens, else the first's."""
    reasons = [c.finish_reason for c in out.outputs if c.finish_reason]
    if "length" in reasons:
        return "length"
    return reasons[0] if reasons else "stop"
