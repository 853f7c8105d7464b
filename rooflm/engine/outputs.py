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
