"""The front-end protocol: EngineClient, the one interface between the server and an engine.

Three front ends implement it, and the server (server/state.py) calls only what
is declared here:
  AsyncLLMEngine   (engine/async_engine.py) the engine on a thread of the API process;
  EngineCoreClient (engine/core_client.py)  the engine in a process of its own
                                             (engine/core.py), over ZMQ;
  DPClient         (dp/client.py)           N engine-core processes behind a router,
                                             one EngineCoreClient each.
Each is built as `Front(engine, limits, metrics)` (EngineClientFactory) from an
engine face (an LLMEngine, an EngineCoreProcess, a ReplicaSet) and owns it from
start() on.

A request's life, the same in all three: generate() admits a group of
GenerateRequests all together or none, and returns one RequestStream per
request. Where the engine runs, each step's outputs go to their request's
stream; RequestStream.next() returns them in step order until one says
finished. An abort ends a request at the engine's next chance; an engine that
fails ends every stream with EngineDeadError.

Below the protocol, what its implementations share: RequestStream, the
admission half of generate() (admit_group), the bookkeeping of an admitted
request's latency metrics (TrackedRequest), and the metrics sinks.
"""

from __future__ import annotations

import abc
import asyncio
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional, Union

from rooflm.engine.outputs import RequestOutput, merge_outputs
from rooflm.engine.report import EngineSnapshot
from rooflm.engine.request_types import AdmissionLimits, GenerateRequest


@dataclass(frozen=True)
class RestartPolicy:
    """Whether a core that dies is restarted, and when it stays down: at its max_deaths-th
    death within window_s seconds (a crash loop: a restart would only die again)."""

    enabled: bool = False
    max_deaths: int = 5
    window_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_deaths < 1:
            raise ValueError(f"the crash-loop guard's max_deaths must be >= 1, got {self.max_deaths}")
        if self.window_s <= 0:
            raise ValueError(f"the crash-loop guard's window_s must be > 0, got {self.window_s}")


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


class EngineClient(abc.ABC):
    """The server's one way to an engine. Every method is called on the event loop that
    called start(); only stop() may block it.

    Errors: generate() raises them (AdmissionRejected: busy, retry later; ValueError or
    rooflm.errors.InvalidRequest: the engine refused an input, nothing was queued;
    EngineDeadError: the engine failed or is not running). Once admitted, a request's
    failures arrive in its stream: next() raises EngineDeadError when the engine fails,
    RequestAborted(reason) when the server aborted it with a reason.
    """

    @abc.abstractmethod
    def start(self, on_dead: Optional[Callable[[BaseException], None]] = None) -> None:
        """Start serving (call on the event loop that will await results). on_dead(exc) is
        called on that loop once, after the engine failed and every stream got its error."""

    @abc.abstractmethod
    async def shutdown(self, timeout: float = 10.0) -> None:
        """Abort every request (streams raise RequestAborted) and stop the engine, waiting up to
        `timeout` seconds for it without blocking the event loop."""

    @abc.abstractmethod
    def stop(self, timeout: float = 10.0) -> None:
        """shutdown(), blocking: for a caller with no event loop to await on."""

    @abc.abstractmethod
    async def generate(self, requests: list[GenerateRequest],
                       bypass_limits: bool = False) -> list[RequestStream]:
        """Admit a group of requests all together, or none of them; one stream per request,
        in order. bypass_limits skips admission control (the server's warm-up).

        A caller cancelled while waiting leaves nothing behind: the group is aborted, even
        if the engine admits it after all.
        """

    @abc.abstractmethod
    def abort(self, request_ids: list[str], reason: Optional[str] = None) -> None:
        """Abort requests; the engine frees their blocks at its next chance. Never blocks;
        ids that finished already (or were never admitted) are ignored.

        Without a reason nobody is told (the caller is gone); with one, each request's
        stream raises RequestAborted(reason).
        """

    @abc.abstractmethod
    def abort_all(self, reason: str) -> None:
        """abort() every admitted request (and any group being admitted), telling each stream."""

    @abc.abstractmethod
    def health(self, stall_seconds: float) -> Optional[str]:
        """None while the engine is alive and made progress in the last stall_seconds;
        else why not, in words for /health."""

    @abc.abstractmethod
    async def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode: abort every request (each stream raises RequestAborted), then the
        engine frees its KV pool and moves its weights to host memory (level 1) or drops them
        (level 2). Until wake_up(), generate() raises AdmissionRejected (503, code "sleeping").
        Raises ValueError when the engine was built without sleep mode, InvalidRequest
        (param "level") for a level other than 1 or 2. Sleeping again is a no-op."""

    @abc.abstractmethod
    async def wake_up(self) -> Optional[dict]:
        """Undo sleep(): the weights back, a fresh KV pool; a no-op when awake. Returns where
        the time went (LLMEngine.wake_up: seconds per phase), None when it was awake."""

    @property
    @abc.abstractmethod
    def is_sleeping(self) -> bool:
        """Whether the engine sleeps (as of the last sleep() or wake_up() that returned)."""

    @property
    def is_restarting(self) -> bool:
        """Whether a failed engine is being restarted (engine-core front ends with a restart
        policy); while it is, new requests wait for it and health() says so."""
        return False

    @property
    @abc.abstractmethod
    def is_dead(self) -> bool:
        """The engine failed: no request can make progress any more."""

    @property
    @abc.abstractmethod
    def num_in_flight(self) -> int:
        """Requests admitted and not yet finished or aborted."""

    @property
    @abc.abstractmethod
    def snapshot(self) -> EngineSnapshot:
        """The engine's state as last published (after a step, or a heartbeat): one
        consistent EngineSnapshot, for logs and gauges."""


SLEEP_ABORT_REASON = "the engine was put to sleep"


# How the server builds its front end: (engine face, limits, metrics) -> EngineClient.
EngineClientFactory = Callable[[object, AdmissionLimits, object], EngineClient]


async def admit_group(requests: list[GenerateRequest],
                      send: Callable[[list[RequestStream]], Awaitable[None]],
                      abort: Callable[[list[str]], None]) -> list[RequestStream]:
    """generate()'s common half: a stream per request, the group sent with them (send
    returns what resolves when the engine answers), the answer awaited. A caller that gives
    up (cancelled) aborts the group: the add may still happen, and the abort sent after it
    undoes it."""
    streams = [RequestStream(r.request_id) for r in requests]
    answered = send(streams)
    try:
        await answered
    except asyncio.CancelledError:
        abort([r.request_id for r in requests])
        raise
    return streams


class StepTokens:
    """The tokens one step delivered, counted for metrics.add_tokens."""

    __slots__ = ("prompt", "generation")

    def __init__(self):
        self.prompt = 0
        self.generation = 0


class TrackedRequest:
    """An admitted request as its front end follows it: the request, its stream, and the
    times its latency metrics come from (arrival, first scheduled, first and last token)."""

    __slots__ = ("request", "stream", "scheduled_time", "first_token_time", "last_token_time")

    def __init__(self, request: GenerateRequest, stream: RequestStream):
        self.request = request
        self.stream = stream
        self.scheduled_time: Optional[float] = None
        self.first_token_time: Optional[float] = None
        self.last_token_time: Optional[float] = None

    def tokens_arrived(self, new_tokens: int, now: float, metrics, counts: StepTokens) -> None:
        """new_tokens (> 0) reached the front end at `now`: observe the time to first token,
        or the gap since the last tokens, and count them (with the prompt, the first time)."""
        request = self.request
        if request.record_metrics:
            if self.first_token_time is None:
                metrics.observe_first_token(now - request.arrival_time)
                counts.prompt += len(request.prompt_token_ids)
            else:
                metrics.observe_inter_token(now - self.last_token_time)
            counts.generation += new_tokens
        self.first_token_time = self.first_token_time or now
        self.last_token_time = now

    def observe_end(self, metrics, reason: str, now: float,
                    out: Optional[RequestOutput] = None) -> None:
        """The request's end in the metrics: its reason, and unless it was aborted its
        end-to-end and queue time, and (given its last output) its phases and lengths."""
        request = self.request
        if not request.record_metrics:
            return
        e2e = queued = None
        if reason != "abort":
            e2e = now - request.arrival_time
            if self.scheduled_time is not None:
                queued = self.scheduled_time - request.arrival_time
            prefill, decode = request_phases(self.scheduled_time, self.first_token_time,
                                             self.last_token_time)
            if out is not None:
                metrics.observe_request(len(request.prompt_token_ids),
                                        [len(s.token_ids) for s in out.outputs], prefill, decode)
        metrics.observe_finished(reason, e2e, queued)

    def observe_failure(self, metrics) -> None:
        """The engine failed under this request."""
        if self.request.record_metrics:
            metrics.observe_finished("error", None, None)


def request_phases(scheduled: Optional[float], first_token: Optional[float],
                   last_token: Optional[float]) -> tuple[Optional[float], Optional[float]]:
    """(prefill, decode) seconds as vLLM defines them: first scheduled to first token, first
    token to last; None where a timestamp is missing (never scheduled, no token)."""
    if first_token is None:
        return None, None
    prefill = None if scheduled is None else first_token - scheduled
    return prefill, (last_token or first_token) - first_token


def finish_reason_of(out: RequestOutput) -> str:
    """One reason per request: "length" if any sample ran out of tokens, else the first's."""
    reasons = [c.finish_reason for c in out.outputs if c.finish_reason]
    if "length" in reasons:
        return "length"
    return reasons[0] if reasons else "stop"


class NullMetrics:
    """The metrics interface a front end writes to; records nothing."""

    def set_scheduler_state(self, running, waiting, kv_usage, free_blocks, num_blocks): pass
    def set_tokens_in_flight(self, tokens): pass
    def set_service_state(self, predicted_wait_s, is_sleeping): pass
    def add_prefix_cache(self, queries, hits, host_hits=0): pass
    def set_kv_offload_state(self, used_blocks, offloaded, restored): pass
    def add_preemptions(self, count): pass
    def add_tokens(self, prompt_tokens, generation_tokens): pass
    def set_lora_state(self, max_loras, running, waiting, added_requests): pass
    def observe_first_token(self, ttft_seconds): pass
    def observe_inter_token(self, seconds): pass
    def observe_finished(self, reason, e2e_seconds, queue_seconds): pass
    def observe_request(self, prompt_tokens, sample_tokens, prefill_seconds, decode_seconds): pass


class SnapshotMetrics:
    """The engine's state as metrics: gauges set from each snapshot, counters advanced by what
    changed since the previous one. Shared by the engine thread and the engine-core client."""

    def __init__(self, metrics):
        self.metrics = metrics
        self._seen_prefix = (0, 0, 0)
        self._seen_preemptions = 0
        self._seen_spec = None  # the last SpecSnapshot published
        self._seen_lora_requests: dict[str, int] = {}

    def publish(self, snap: EngineSnapshot, tokens_in_flight: int) -> None:
        metrics = self.metrics
        metrics.set_scheduler_state(snap.num_running_reqs, snap.num_waiting_reqs + snap.num_swapped_reqs,
                                    snap.kv_usage, snap.num_free_blocks, snap.num_blocks)
        metrics.set_tokens_in_flight(tokens_in_flight)
        metrics.set_service_state(snap.predicted_wait_s, snap.is_sleeping)
        queries, hits, host_hits = self._seen_prefix
        metrics.add_prefix_cache(snap.prefix_queried_tokens - queries, snap.prefix_hit_tokens - hits,
                                 snap.prefix_host_hit_tokens - host_hits)
        self._seen_prefix = (snap.prefix_queried_tokens, snap.prefix_hit_tokens, snap.prefix_host_hit_tokens)
        metrics.set_kv_offload_state(snap.num_offload_used_blocks, snap.num_offloaded_blocks,
                                     snap.num_restored_blocks)
        metrics.add_preemptions(snap.num_preemptions - self._seen_preemptions)
        self._seen_preemptions = snap.num_preemptions
        if snap.spec is not None:
            self._publish_spec(snap.spec)
        if snap.lora is not None:
            self._publish_lora(snap.lora)

    def _publish_lora(self, lora) -> None:
        seen = self._seen_lora_requests
        added = {name: n - seen.get(name, 0) for name, n in lora.requests if n > seen.get(name, 0)}
        self._seen_lora_requests = dict(lora.requests)
        self.metrics.set_lora_state(lora.max_loras, dict(lora.running), dict(lora.waiting), added)

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
