"""What a front end hands the engine, and the errors it answers with.

Both sides of the front-end protocol (engine/client.py) use these: the front
ends in the API process (async_engine.py, core_client.py, dp/client.py) and
the loops where the engine runs (the engine thread, the engine-core process:
serving_loop.py). They are plain dataclasses and exceptions, so a
GenerateRequest crosses the engine-core socket as it is (core_protocol.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from rooflm.lora.request import LoRARequest
from rooflm.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine loop failed; no request can make progress any more."""


class AdmissionRejected(Exception):
    """The server is too busy (429) or not taking work (503); retry later.

    code: why, for the client's error body and the metrics: "overloaded" (the queue or the
    tokens in flight are full), "slo_shed" (the predicted wait exceeds the request's TTFT
    budget), "sleeping" (the engine sleeps)."""

    def __init__(self, message: str, status: int = 429, retry_after_s: int = 1,
                 code: str = "overloaded"):
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s
        self.code = code


class RequestAborted(Exception):
    """The server aborted the request (shutdown, stop) while someone waited on it."""


@dataclass
class AdmissionLimits:
    max_queued_requests: int = 64
    max_tokens_in_flight: int = 0  # 0: no cap
    # The server's TTFT budget in milliseconds (--ttft-slo-ms): a request whose predicted
    # queueing time already exceeds it is refused with 503 before any prefill. 0: none.
    ttft_slo_ms: float = 0.0


@dataclass
class GenerateRequest:
    """One prompt to generate for; params.max_tokens must already be resolved."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: Optional[str] = None
    arrival_time: float = field(default_factory=time.monotonic)
    record_metrics: bool = True  # False for the server's own warm-up
    priority: int = 0  # --scheduling-policy priority: lower first
    # This request's own TTFT budget in milliseconds from arrival; None: the server's.
    deadline_ms: Optional[float] = None
    # The LoRA adapter the request runs under (the OpenAI `model` field named it); None: the base.
    lora_request: Optional[LoRARequest] = None

    @property
    def reserved_tokens(self) -> int:
        """The most tokens this request can put in the KV cache."""
        return len(self.prompt_token_ids) + self.params.n * (self.params.max_tokens or 0)
