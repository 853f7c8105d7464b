"""What the engine hands back to its callers after each step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

# One position's logprobs: token id -> (logprob, rank). The sampled (or prompt)
# token is always present; the top-N alternatives follow it.
Logprobs = dict[int, "TokenLogprob"]


@dataclass
class TokenLogprob:
    logprob: float
    rank: int  # 1 = most likely
    decoded: str = ""


@dataclass
class CompletionOutput:
    """One of the n samples of a request, cumulative so far."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: Optional[list[Logprobs]] = None
    finish_reason: Optional[str] = None  # None while running; "stop" | "length" | "abort"
    stop_reason: Optional[object] = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of a request after a step.

    text and token_ids are cumulative; `delta_text`/`delta_token_ids` on each
    sample's stream hold what this step added, so a streaming server sends
    deltas without diffing strings.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: Optional[list[Optional[Logprobs]]] = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    delta_text: list[str] = field(default_factory=list)  # per sample
    delta_token_ids: list[list[int]] = field(default_factory=list)  # per sample
    error: Optional[str] = None  # set when the engine failed this request
    # The request's timestamps (time.monotonic() seconds) where the engine runs in this process:
    # timings such as generate's summary line (TTFT) read them.
    arrival_time: Optional[float] = None
    first_token_time: Optional[float] = None


def merge_outputs(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one: the later's state, both steps' deltas.

    A stream whose reader falls behind the engine (hundreds of streams on one event loop)
    hands the reader everything that has piled up as one output, so the per-chunk cost of
    the HTTP side (JSON, SSE, socket write) is paid once for several tokens instead of
    once per token, as vLLM's output collector does.
    """
    width = max(len(earlier.delta_text), len(later.delta_text))

    def at(values: list, i: int, empty):
        return values[i] if i < len(values) else empty

    return RequestOutput(
        request_id=later.request_id, prompt=later.prompt, prompt_token_ids=later.prompt_token_ids,
        outputs=later.outputs, finished=later.finished, prompt_logprobs=later.prompt_logprobs,
        num_cached_tokens=later.num_cached_tokens,
        delta_text=[at(earlier.delta_text, i, "") + at(later.delta_text, i, "") for i in range(width)],
        delta_token_ids=[at(earlier.delta_token_ids, i, []) + at(later.delta_token_ids, i, [])
                         for i in range(width)],
        error=later.error, arrival_time=later.arrival_time, first_token_time=later.first_token_time)
