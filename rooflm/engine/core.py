"""The engine-core process: the LLMEngine's step loop, fed and read over ZMQ (core_protocol.py).

Why a process: in one process the engine thread and the server's event loop
share one interpreter lock, and at a few hundred sequences per step the loop
building SSE chunks keeps the engine waiting for it (vLLM's engine
core and SGLang's scheduler process exist for the same reason). Here the step
loop has an interpreter to itself; the API process (core_client.py) does HTTP,
validation, tokenization, chat templates and SSE.

The loop:
  1. take the input: when there is no work, wait for a message (at most
     IDLE_TICK_S); when there is, take only what has already arrived;
  2. apply it in order: limits, groups of requests (admission, then
     engine.add_request; every group gets an AddReply), aborts, shutdown;
  3. with work, run one step and send one StepOutputs: every request's new
     tokens, the StepReports of the steps it collected, and the core's state;
     without, send a Heartbeat with the state.

Admission runs here, where the real queue is (serving_loop.admission_check,
the same rule as in-process): a group is refused when the waiting queue would
pass max_queued_requests or the tokens reserved in flight would pass
max_tokens_in_flight.

Detokenization and stop strings run here, in the engine's output processor, as
in-process: a stop string ends its sequence in the step that produced it, so
its blocks are freed at once and no step is spent past it; matched in the API
process, the core would keep generating (and holding KV blocks) until an abort
came back. The core ships each step's text deltas, so the API process holds no
detokenizer state. The cost stays in the core: ~17 us per token for the
incremental decode plus two stop strings (SmolLM2's tokenizer, the 2-core CPU
here), beside ~100 us per streamed token of the API process's own work (HTTP,
pydantic, SSE; benchmarks/serve_cpu_cost.py). Should the core's host time
become the limit on a GPU, a profile will say whether moving the text out pays.

Failure: a step that raises aborts every request (freeing their blocks), sends
EngineDead with the error, and the process exits 1. An engine that cannot be
built does the same before EngineReady.

Lifetime: the core dies with its parent. A watcher thread polls the parent's
pid and ends the process when it changes: the API process is gone, however it
went (SIGKILL included). SIGINT and SIGTERM are ignored: a Ctrl-C or a service
manager's SIGTERM reaches the whole process group, and shutdown belongs to the
API process, which drains its requests first and then sends Shutdown.

Profile hook: ROOFLM_ENGINE_CORE_PROFILE=path runs the serving loop under cProfile and writes
its stats to path when the core exits (pstats format).

Test hook: ROOFLM_FAULT_INJECT_STEP=N makes the N-th call to engine.step()
raise (serving_loop.py; counted from 1, the server's warm-up included).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

import msgspec
import zmq

import rooflm.envs as envs
from rooflm.config import EngineConfig
from rooflm.engine.core_protocol import (Abort, AddError, AddReply, AddRequests, Configure,
                                         CoreState, EngineDead, EngineReady, Heartbeat,
                                         RequestDelta, SampleDelta, Shutdown, Sleep, SleepReply,
                                         StepOutputs, encoder, input_decoder)
from rooflm.engine.frame_auth import FrameAuth
from rooflm.engine.llm_engine import LLMEngine
from rooflm.engine.outputs import RequestOutput
from rooflm.engine.request import Request
from rooflm.engine.request_types import AdmissionLimits, AdmissionRejected, GenerateRequest
from rooflm.engine.serving_loop import (EMPTY_STEP_BACKOFF_S, IDLE_TICK_S, CountedSteps, add_group,
                                        admission_check, fault_step_from_env)
from rooflm.errors import InvalidRequest

logger = logging.getLogger(__name__)

# How often the watcher thread checks that the API process is still there.
PARENT_POLL_S = 0.25

# How long the last messages (EngineDead, the final state) get to leave on exit.
SEND_LINGER_MS = 2000


@dataclass
class _Tracked:
    """The core's bookkeeping for one admitted request."""

    request: Request
    reserved_tokens: int
    sent_first_output: bool = False


class EngineCore:
    """The step loop over an LLMEngine and the two sockets; run() serves until Shutdown."""

    def __init__(self, engine, input_socket: zmq.Socket, output_socket: zmq.Socket,
                 fault_inject_step: Optional[int] = None, frames: Optional[FrameAuth] = None):
        self.engine = engine
        self.frames = frames or FrameAuth(None)  # HMAC on tcp:// sockets (frame_auth.py)
        self.limits = AdmissionLimits()
        self._steps = CountedSteps(fault_inject_step)
        self._input = input_socket
        self._output = output_socket
        self._poller = zmq.Poller()
        self._poller.register(input_socket, zmq.POLLIN)
        self._encode = encoder().encode
        self._decode = input_decoder().decode
        self._tracked: dict[str, _Tracked] = {}
        self._tokens_in_flight = 0
        self._last_progress = time.monotonic()
        self._reports: list = []
        engine.add_observer(self._reports.append)

    # ---- the loop ---------------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until Shutdown. A failing step raises; the caller reports it (EngineDead)."""
        self._send(EngineReady(self.engine.info, self.state()))
        backoff = False
        while True:
            self.engine.check_alive()  # a tensor-parallel worker that died fails the core
            messages = self._receive(self._wait_s(backoff))
            for message in messages:
                if isinstance(message, Shutdown):
                    self.abort_all()
                    return
                self._apply(message)
            if self.engine.has_unfinished_requests():
                backoff = not self._step()
                if backoff and messages:
                    self._send(Heartbeat(self.state()))  # the gauges see the adds and aborts
            else:
                backoff = False
                self._last_progress = time.monotonic()  # idle: the loop is alive
                self._send(Heartbeat(self.state()))

    def _wait_s(self, backoff: bool) -> float:
        if not self.engine.has_unfinished_requests():
            return IDLE_TICK_S
        # Work that schedules nothing (every waiting request is short of KV blocks): back
        # off instead of spinning a core.
        return EMPTY_STEP_BACKOFF_S if backoff else 0.0

    def _receive(self, timeout_s: float) -> list:
        """The messages already queued; waits up to timeout_s for the first one."""
        if timeout_s > 0 and not self._poller.poll(int(timeout_s * 1000)):
            return []
        messages = []
        while True:
            try:
                frame = self._input.recv(zmq.NOBLOCK)
            except zmq.Again:
                return messages
            frame = self.frames.open(frame)
            if frame is None:
                continue  # not from the API process: dropped and counted
            try:
                messages.append(self._decode(frame))
            except msgspec.DecodeError as exc:
                # A bug in the API process, or someone else's bytes: never run them, never die.
                logger.error("dropped an undecodable input message (%d bytes): %s", len(frame), exc)

    def _send(self, message) -> None:
        # Blocking: when the API process falls 1000 messages behind (ZMQ's high-water mark),
        # the engine waits for it rather than queue without bound.
        self._output.send(self.frames.seal(self._encode(message)))

    def state(self) -> CoreState:
        return CoreState(self.engine.snapshot(), self._tokens_in_flight, self._last_progress)

    # ---- commands -----------------------------------------------------------------------------------

    def _apply(self, message) -> None:
        if isinstance(message, AddRequests):
            self._send(AddReply(message.batch_id, self._add(message)))
        elif isinstance(message, Abort):
            ids = list(self._tracked) if message.request_ids is None else message.request_ids
            self._abort(ids)
        elif isinstance(message, Sleep):
            error, phases = self._sleep(message.level)
            self._send(SleepReply(message.call_id, self.engine.is_sleeping, error, phases))
        elif isinstance(message, Configure):
            self.limits = AdmissionLimits(message.max_queued_requests, message.max_tokens_in_flight,
                                          message.ttft_slo_ms)

    def _sleep(self, level: Optional[int]) -> tuple[Optional[AddError], Optional[dict]]:
        """Sleep at `level` (every request aborted first: the API process tells their streams
        when the reply arrives), or wake up (None); the error that stopped it, if any, and a
        wake-up's phases (LLMEngine.wake_up)."""
        try:
            if level is None:
                return None, self.engine.wake_up()
            self.engine.check_sleep_level(level)
            self.abort_all()
            self.engine.sleep(level)
        except InvalidRequest as exc:
            return AddError("invalid", exc.message, param=exc.param), None
        except ValueError as exc:
            return AddError("value", str(exc)), None
        except Exception as exc:  # noqa: BLE001 - the caller is told
            logger.exception("sleep mode: %s failed", "wake_up" if level is None else "sleep")
            return AddError("error", f"{type(exc).__name__}: {exc}"), None
        return None, None

    def _add(self, message: AddRequests) -> Optional[AddError]:
        """Admit the group, all or nothing; the error that refused it, if any."""
        try:
            self._admit(message.requests, message.bypass_limits)
        except InvalidRequest as exc:
            return AddError("invalid", exc.message, param=exc.param)
        except AdmissionRejected as exc:
            return AddError("busy", str(exc), status=exc.status, retry_after_s=exc.retry_after_s,
                            code=exc.code)
        except ValueError as exc:
            return AddError("value", str(exc))
        except Exception as exc:  # noqa: BLE001 - every refusal goes back to the caller
            logger.exception("unexpected error while adding requests")
            return AddError("error", f"{type(exc).__name__}: {exc}")
        return None

    def _admit(self, requests: list[GenerateRequest], bypass_limits: bool) -> None:
        if not bypass_limits:
            rejection = admission_check(self.engine, self.limits, self._tokens_in_flight, requests)
            if rejection is not None:
                raise rejection
        for request, engine_request in zip(requests, add_group(self.engine, requests)):
            self._tracked[request.request_id] = _Tracked(engine_request, request.reserved_tokens)
            self._tokens_in_flight += request.reserved_tokens

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            tracked = self._tracked.pop(request_id, None)
            if tracked is not None:
                self.engine.abort_request(request_id)
                self._tokens_in_flight -= tracked.reserved_tokens

    def abort_all(self) -> None:
        self._abort(list(self._tracked))

    # ---- the step ------------------------------------------------------------------------------------

    def _step(self) -> bool:
        """One engine step and its StepOutputs; returns whether the step did any work."""
        outputs, did_work = self._steps.run(self.engine)
        if did_work:
            self._last_progress = time.monotonic()
        if did_work or outputs or self._reports:
            deltas = self._deltas(outputs)
            reports = list(self._reports)
            self._reports.clear()  # the list the engine's observer appends to
            self._send(StepOutputs(deltas, reports, self.state()))
        return did_work

    def _deltas(self, outputs: list[RequestOutput]) -> list[RequestDelta]:
        deltas = []
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue  # aborted while its step was in flight
            deltas.append(self._delta(out, tracked))
            if out.finished:
                del self._tracked[out.request_id]
                self._tokens_in_flight -= tracked.reserved_tokens
        return deltas

    @staticmethod
    def _delta(out: RequestOutput, tracked: _Tracked) -> RequestDelta:
        # An output_kind "final" request has its one output now: all of it is news.
        whole = not tracked.sent_first_output and tracked.request.params.output_kind == "final"
        samples = []
        for position, sample in enumerate(out.outputs):
            if whole:
                ids, text, logprobs = sample.token_ids, sample.text, sample.logprobs
            else:
                ids = out.delta_token_ids[position] if position < len(out.delta_token_ids) else []
                text = out.delta_text[position] if position < len(out.delta_text) else ""
                # One logprob entry per new token, appended with it: the newest len(ids) entries.
                logprobs = sample.logprobs[-len(ids):] if ids and sample.logprobs else None
            samples.append(SampleDelta(sample.index, ids, text, logprobs or None,
                                       sample.finish_reason, sample.stop_reason))
        prompt_logprobs = None
        if not tracked.sent_first_output:
            tracked.sent_first_output = True
            prompt_logprobs = out.prompt_logprobs
        queued_s = None
        request = tracked.request
        if out.finished and request.scheduled_time is not None:
            queued_s = request.scheduled_time - request.arrival_time
        return RequestDelta(out.request_id, samples, out.finished, out.num_cached_tokens,
                            prompt_logprobs, queued_s)


# ---- the process ------------------------------------------------------------------------------------


def run_engine_core(config_bytes: bytes, input_address: str, output_address: str,
                    parent_pid: int, log_level: int, rooflm_log_level: int = logging.NOTSET,
                    secret: Optional[bytes] = None) -> None:
    """The process's entry point (multiprocessing 'spawn'): build the engine, serve, exit.

    config_bytes: the EngineConfig, msgspec-encoded. secret: the HMAC key of a core reached
    over tcp:// (frame_auth.py); None on ipc://. Exits 0 after Shutdown, 1 on a failure.
    """
    _ignore_interrupts()
    _exit_with_parent(parent_pid, _socket_dir(input_address))
    logging.basicConfig(level=log_level,
                        format="%(levelname)s %(name)s (engine core): %(message)s")
    logging.getLogger("rooflm").setLevel(rooflm_log_level)  # the server's: start-up progress
    context = zmq.Context()
    input_socket = context.socket(zmq.PULL)
    input_socket.bind(input_address)
    output_socket = context.socket(zmq.PUSH)
    output_socket.connect(output_address)
    exit_code = 0
    core = None
    frames = FrameAuth(secret)
    try:
        config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
        core = EngineCore(LLMEngine(config), input_socket, output_socket, fault_step_from_env(), frames)
        with _profiled(envs.get(PROFILE_ENV)):
            core.run()
        core.engine.shutdown()  # its tensor-parallel workers, if any
    except BaseException as exc:  # noqa: BLE001 - any failure ends the core; the API is told
        # A model that cannot be loaded as given (ValueError) is the user's to fix: its
        # message says what is wrong, and the API process prints it.
        user_error = core is None and isinstance(exc, ValueError)
        logger.error("the engine %s: %s", "could not start" if core is None else "failed", exc,
                     exc_info=None if user_error else exc)
        output_socket.send(frames.seal(encoder().encode(EngineDead(f"{type(exc).__name__}: {exc}",
                                                       _state_after_failure(core)))))
        exit_code = 1
    finally:
        input_socket.close(linger=0)
        output_socket.close(linger=SEND_LINGER_MS)
        context.term()
    sys.exit(exit_code)


# A path: the core's serving loop runs under cProfile and its stats are written there at exit
# (pstats format; the API process is not profiled). For finding what limits a served workload
# where no sampling profiler is at hand; cProfile slows Python down, so not for timing.
PROFILE_ENV = "ROOFLM_ENGINE_CORE_PROFILE"


@contextlib.contextmanager
def _profiled(path: Optional[str]):
    if not path:
        yield
        return
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
        profiler.dump_stats(path)
        logger.info("engine core profile written to %s", path)


def _state_after_failure(core: Optional[EngineCore]) -> Optional[CoreState]:
    """Abort every request (best effort: free their blocks) and say where the core stands."""
    if core is None:
        return None
    try:
        core.abort_all()
        return core.state()
    except Exception:  # noqa: BLE001 - the engine is already broken
        logger.exception("could not abort the failed requests")
        return None


def _ignore_interrupts() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _socket_dir(address: str) -> Optional[str]:
    """The directory of an ipc:// socket file (the API process made it for the two sockets)."""
    return os.path.dirname(address[len("ipc://"):]) if address.startswith("ipc://") else None


def _exit_with_parent(parent_pid: int, socket_dir: Optional[str]) -> None:
    """End this process as soon as the API process is gone: the core never outlives it, and
    the socket files it leaves go with the core (a killed API process removes nothing)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        logger.error("the API process (pid %d) is gone; the engine core exits", parent_pid)
        if socket_dir is not None:
            shutil.rmtree(socket_dir, ignore_errors=True)
        os._exit(1)

    threading.Thread(target=watch, name="rooflm-parent-watch", daemon=True).start()
