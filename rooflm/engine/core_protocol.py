"""The messages between the API process and the engine-core process, and their one encoding.

Two ZMQ PUSH/PULL sockets join the processes, one per direction; each side
binds the socket it reads and connects the one it writes, so a writer's first
messages wait in its queue until the reader is there and no send waits on a
handshake. Every message is a msgspec Struct, tagged with its class name and
encoded as MessagePack. The decoder builds only the types named here, so a
frame can carry data and never code: no pickle touches these sockets (pickle
runs whatever a peer sends). The engine's face (EngineInfo, EngineSnapshot,
StepReport) and the request's own types (GenerateRequest, SamplingParams,
TokenLogprob) are plain dataclasses and cross as they are.

API process -> engine core (the input socket):
  Configure     the admission limits; the first message, before any request
  AddRequests   a group of requests to admit all together or not at all; answered by AddReply
  Abort         requests to stop (None: every one); nobody is answered, blocks are freed
  Sleep         sleep mode: abort everything, then sleep at a level (None: wake up);
                answered by SleepReply
  Shutdown      abort everything and exit 0

Engine core -> API process (the output socket):
  EngineReady   once, when the engine is built: its EngineInfo
  AddReply      a group was admitted, or why not (the error names the field, or says busy)
  SleepReply    a Sleep was done, or why not; whether the engine sleeps now
  StepOutputs   one per engine step: every request's new tokens (ids, text, logprobs,
                finish), the step's StepReports and the core's state after it
  Heartbeat     the core's state while it has no step to report (idle, or after commands)
  EngineDead    the engine failed, or could not start; the core exits 1 right after

Times (GenerateRequest.arrival_time, CoreState.last_progress) are time.monotonic()
of either process: CLOCK_MONOTONIC is one clock for the whole host, so the two
processes' readings compare.
"""

from __future__ import annotations

from typing import Optional, Union

import msgspec

from rooflm.engine.request_types import GenerateRequest
from rooflm.engine.outputs import TokenLogprob
from rooflm.engine.report import EngineInfo, EngineSnapshot, StepReport

# outputs.Logprobs names its value type as a string, which msgspec would look up here.
Logprobs = dict[int, TokenLogprob]

# ---- API process -> engine core --------------------------------------------------------------


class Configure(msgspec.Struct, tag=True):
    max_queued_requests: int
    max_tokens_in_flight: int  # 0: no cap
    ttft_slo_ms: float = 0.0  # 0: no server-wide TTFT budget


class AddRequests(msgspec.Struct, tag=True):
    batch_id: int  # the AddReply answering this group carries it back
    requests: list[GenerateRequest]
    bypass_limits: bool = False  # the server's own warm-up


class Abort(msgspec.Struct, tag=True):
    request_ids: Optional[list[str]]  # None: every request


class Sleep(msgspec.Struct, tag=True):
    call_id: int  # the SleepReply answering it carries it back
    level: Optional[int]  # 1 or 2; None: wake up


class Shutdown(msgspec.Struct, tag=True):
    pass


InputMessage = Union[Configure, AddRequests, Abort, Sleep, Shutdown]

# ---- engine core -> API process --------------------------------------------------------------


class CoreState(msgspec.Struct, array_like=True):
    """Where the core stands: what the gauges, the log line and /health read."""

    snapshot: EngineSnapshot
    tokens_in_flight: int  # reserved by admitted requests: prompt + n * max_tokens
    last_progress: float  # monotonic time of the core's last step that did work, or idle loop


class AddError(msgspec.Struct, array_like=True):
    """Why a group was not admitted; the API process raises the matching exception."""

    kind: str  # "invalid" (InvalidRequest), "busy" (AdmissionRejected), "value" (ValueError), "error"
    message: str
    param: Optional[str] = None  # "invalid": the request field at fault
    status: int = 429  # "busy": the HTTP status and Retry-After the API answers with
    retry_after_s: int = 1
    code: str = "overloaded"  # "busy": AdmissionRejected.code


class EngineReady(msgspec.Struct, tag=True):
    info: EngineInfo
    state: CoreState


class AddReply(msgspec.Struct, tag=True):
    batch_id: int
    error: Optional[AddError] = None  # None: every request of the group is queued


class SleepReply(msgspec.Struct, tag=True):
    call_id: int
    is_sleeping: bool
    error: Optional[AddError] = None  # None: done
    wake_phases: Optional[dict] = None  # a wake-up's LLMEngine.wake_up() answer: where its time went


class SampleDelta(msgspec.Struct, array_like=True):
    """What one step added to one of a request's n samples."""

    index: int
    token_ids: list[int]
    text: str  # detokenized in the core, stop strings applied
    logprobs: Optional[list[Logprobs]]  # one entry per new token, when the request asked
    finish_reason: Optional[str]
    stop_reason: Union[str, int, None]  # the stop string or stop token id that ended it


class RequestDelta(msgspec.Struct, array_like=True):
    """One request's news from one step. The API process keeps the cumulative state."""

    request_id: str
    samples: list[SampleDelta]
    finished: bool
    num_cached_tokens: int
    # Sent once, with the request's first output: by then the whole prompt was computed.
    prompt_logprobs: Optional[list[Optional[Logprobs]]] = None
    # Sent when the request finishes: arrival to first scheduled, in seconds (None: never ran).
    queued_s: Optional[float] = None


class StepOutputs(msgspec.Struct, tag=True):
    outputs: list[RequestDelta]
    reports: list[StepReport]  # the steps collected by this engine step (one, or none)
    state: CoreState


class Heartbeat(msgspec.Struct, tag=True):
    state: CoreState


class EngineDead(msgspec.Struct, tag=True):
    error: str  # "<exception type>: <message>"
    state: Optional[CoreState] = None  # after the failed requests' blocks were freed, if it could


OutputMessage = Union[EngineReady, AddReply, SleepReply, StepOutputs, Heartbeat, EngineDead]

# ---- the encoding ---------------------------------------------------------------------------------


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def input_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what the core reads; anything else raises msgspec.DecodeError."""
    return msgspec.msgpack.Decoder(InputMessage)


def output_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what the API process reads; anything else raises msgspec.DecodeError."""
    return msgspec.msgpack.Decoder(OutputMessage)
