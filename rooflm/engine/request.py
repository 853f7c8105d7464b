"""The request and its sequences: the one source of truth the scheduler reads.

Everything is driven by two counters per sequence: num_computed_tokens (whose
K/V is in the cache) catching up with num_tokens (prompt + generated). A
prefill, a prefill chunk, a prefix-cache hit and a decode step are the same
thing: schedule the tokens between the two counters.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from rooflm.engine.block_manager import BlockTable
from rooflm.engine.outputs import Logprobs
from rooflm.lora.request import LoRARequest
from rooflm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not yet admitted, or preempted by recompute
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its K/V moved to host memory
    FINISHED = "finished"


@dataclass
class Sequence:
    """One of the n samples of a request."""

    seq_id: int
    index: int  # which of the n samples
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    # Tokens sampled on the device whose ids the host has not read yet (async scheduling):
    # they count in num_tokens, so the next step can already compute them.
    num_pending: int = 0
    # Handed out by the block manager when the scheduler takes the request in (or forks it).
    block_table: Optional[BlockTable] = None
    finish_reason: Optional[str] = None
    stop_reason: object = None
    output_logprobs: list[Logprobs] = field(default_factory=list)
    # Text state is owned by the engine's output processor (detokenizer, stop matcher).
    output_text: str = ""
    detokenizer: object = None
    stop_matcher: object = None
    # Structured outputs: this sequence's grammar matcher (structured.matcher.SequenceGrammar),
    # made at its first bitmask fill and advanced by the output processor on each token.
    grammar: object = None
    # Speculative decoding (rooflm/spec/): draft slots the next step may verify after this
    # sequence's last token; set before scheduling, 0 when it does not speculate.
    num_spec_slots: int = 0
    # K/V slots past the computed tokens that a step still in flight may write (the device loop,
    # spec/loop.py): the rollback after a verify step keeps their blocks.
    num_lookahead_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending

    # Generated tokens, also appended to token_ids; kept apart so that readers (the sampler's
    # penalties, outputs) need no per-step slice of a long list.
    output_token_ids: list[int] = field(default_factory=list)

    def append_token(self, token: int) -> None:
        """A sampled token's id arrives on the host: it stops being pending."""
        self.token_ids.append(token)
        self.output_token_ids.append(token)
        self.num_pending = max(0, self.num_pending - 1)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host knows, i.e. without the pending ones."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens


@dataclass
class Request:
    """A sequence group: the prompt and its n samples, scheduled and preempted together.

    Until the prompt is computed the request has a single sequence; at its first
    sample it forks into n sequences that share the prompt's blocks.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved against the context length at admission
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: Optional[str] = None
    # --scheduling-policy priority: lower values are scheduled first, ties by arrival time.
    priority: int = 0
    status: RequestStatus = RequestStatus.WAITING
    seqs: list[Sequence] = field(default_factory=list)
    # Seeded requests: sample i's generator (seed + i), on the logits' device; empty: global RNG.
    generators: list[torch.Generator] = field(default_factory=list)
    prompt_logprobs: Optional[list[Optional[Logprobs]]] = None
    num_cached_tokens: int = 0
    forked: bool = False
    # Timestamps for metrics (monotonic seconds).
    scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    num_preemptions: int = 0
    # Structured outputs: the compiled grammar (structured.compiler.RequestGrammar), which
    # may still be compiling on a worker thread; None for an unconstrained request.
    grammar: object = None
    # --enable-lora: the adapter this request runs under; None: the base model.
    lora_request: Optional[LoRARequest] = None

    @property
    def lora_key(self) -> Optional[str]:
        """The adapter's part of the prefix cache's block hashes (None: the base model)."""
        return None if self.lora_request is None else self.lora_request.prefix_key

    @property
    def schedule_key(self) -> tuple[int, float]:
        """Order under the priority policy: the smallest key goes first and is preempted last."""
        return self.priority, self.arrival_time

    @property
    def waiting_for_grammar(self) -> bool:
        """The scheduler admits the request only once its grammar has compiled; one that failed
        to compile waits until the engine finishes it."""
        return self.grammar is not None and not self.grammar.ready

    def generator(self, index: int) -> Optional[torch.Generator]:
        """The generator sample `index` draws from; None: the global RNG."""
        return self.generators[index] if self.generators else None

    @property
    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.finished]

    @property
    def finished(self) -> bool:
        for s in self.seqs:  # a loop, not all(genexpr): read for every request every step
            if s.finish_reason is None:
                return False
        return True

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def needs_fork(self) -> bool:
        return not self.forked and self.params.n > 1

    @property
    def needs_host_tokens(self) -> bool:
        """The next step needs this request's last token ids on the host: penalties read the
        history, and the first sample of n > 1 forks the request."""
        p = self.params
        return (self.needs_fork or p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
                or p.frequency_penalty != 0.0)
