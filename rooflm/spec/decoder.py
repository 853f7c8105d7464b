"""The engine's seam for speculative decoding.

Each step, around the scheduler:
  1. decide and assign (before scheduling): every decoding sequence gets num_spec_slots, the
     drafts it may verify next step: k, shortened by the batch policy below, by its remaining
     max_tokens and by the context length; 0 for sequences that do not speculate (a grammar,
     under min_tokens). The scheduler counts the slots as tokens to compute and allocates their
     K/V. A step that verifies runs synchronously; plain steps keep async scheduling. (Greedy
     batches can instead run spec/loop.py's device loop, which needs no host round trip.)
  2. propose (after scheduling): the proposer fills the slots; unused ones are given back
     (Scheduler.shrink_spec). The runner then verifies the drafts in the step's forward
     (layers/rejection.py) and the output processor appends the accepted ones and rolls the
     rest back (Scheduler.rollback_spec).
  3. observe (after the step): acceptance statistics.

Batch policy: a verify forward computes 1 + k tokens per sequence. While the step's tokens
stay under the GEMMs' ridge point the forward is memory-bound and costs about what a plain
decode step does, so drafts are nearly free; past it, every rejected draft is compute the
batch needed. So k is shortened to keep decode rows x (1 + k) within
speculative_max_batch_tokens (256 on CUDA: an H100's bf16 ridge is ~300 FLOP/byte; 8 on the
CPU), and speculation is off when not even one draft per sequence fits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from rooflm.config import SpeculativeConfig
from rooflm.engine.report import SpecSnapshot
from rooflm.engine.request import Request, Sequence
from rooflm.engine.scheduler import Scheduler, SchedulerOutput
from rooflm.layers.sampler import to_device
from rooflm.spec.policy import SpecPolicy
from rooflm.spec.proposer import DraftRequest, Proposer


@dataclass
class SpecStats:
    """Totals since start, as vLLM's spec_decode counters count them."""

    num_drafts: int = 0  # verify steps of a sequence (with at least one draft)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # accepted drafts at position i
    draft_s: float = 0.0  # host seconds proposing (a draft model's forwards included)
    verify_s: float = 0.0  # seconds of steps with verification, launch to results

    def snapshot(self) -> SpecSnapshot:
        """The totals as the engine's face shows them (acceptance rate, mean accepted length)."""
        return SpecSnapshot(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                            tuple(self.accepted_per_pos), self.draft_s, self.verify_s)


@dataclass
class SpecBatch:
    """A step's proposer output the runner needs beyond the drafts: their distributions."""

    probs: Optional[torch.Tensor]  # [S, K, V] in DraftRequest order, or None (point masses)
    index_of: dict[int, int]  # seq_id -> row of probs

    def draft_probs_for(self, seq_ids: list[int], max_k: int) -> Optional[torch.Tensor]:
        if self.probs is None:
            return None
        index = to_device(torch.tensor([self.index_of[s] for s in seq_ids]), self.probs.device)
        return self.probs.index_select(0, index)[:, :max_k]


class SpecDecoder:
    def __init__(self, cfg: SpeculativeConfig, proposer: Proposer, max_model_len: int,
                 deterministic: bool = False):
        self.cfg = cfg
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.stats = SpecStats(accepted_per_pos=[0] * cfg.num_speculative_tokens)
        # --deterministic promises the same outputs run to run: no timing-driven choices.
        self.policy = SpecPolicy("budget" if deterministic else cfg.speculative_policy)

    def set_proposer(self, proposer: Proposer) -> None:
        """Swap the proposer (benchmarks' replay proposer); it keeps no KV pool."""
        self.proposer = proposer

    def reset_policy(self) -> None:
        """Forget what the policy measured (benchmarks: each variant learns on its own)."""
        self.policy = SpecPolicy(self.policy.mode)

    # ---- 1. before scheduling ------------------------------------------------------------------

    def num_drafts_per_seq(self, num_decoding: int) -> int:
        """k under the batch policy: decode rows x (1 + k) within the token budget."""
        if num_decoding == 0:
            return self.cfg.num_speculative_tokens
        return max(0, min(self.cfg.num_speculative_tokens,
                          self.cfg.speculative_max_batch_tokens // num_decoding - 1))

    def decide(self, scheduler: Scheduler) -> int:
        """k for the next step: the token budget's, 0 where the policy measured that plain steps
        give more tokens per second at this batch size. A k > 0 needs every sequence's tokens on
        the host, so the engine finishes a step in flight before assign()."""
        decoding = scheduler.decoding_seqs()
        k = self.num_drafts_per_seq(len(decoding))
        if k == 0 or not decoding:
            return 0
        # A seeded random request draws its numbers in an order that depends on which steps
        # speculate: timing-driven choices would make its output differ run to run.
        seeded = any(req.params.seed is not None and not req.params.greedy for req, _ in decoding)
        return k if seeded or self.policy.speculate(len(decoding)) else 0

    def assign(self, scheduler: Scheduler, k: int) -> None:
        """Give each decoding sequence its draft slots for the next step (0: a plain step)."""
        scheduler.clear_spec_slots()
        if k == 0:
            return
        for req, seq in scheduler.decoding_seqs():
            seq.num_spec_slots = self._slots(req, seq, k)

    def _slots(self, req: Request, seq: Sequence, k: int) -> int:
        params = req.params
        if req.grammar is not None or seq.num_output_tokens < params.min_tokens:
            return 0  # the grammar's mask and min_tokens' suppression need each token first
        if req.needs_fork:
            return 0  # a one-token prompt of n > 1: its first sample forks the request
        # Verifying k drafts can emit k + 1 tokens: never more than max_tokens or the context allow.
        room = min(req.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_known_tokens)
        return max(0, min(k, room - 1))

    # ---- 2. after scheduling -------------------------------------------------------------------

    def propose(self, out: SchedulerOutput, scheduler: Scheduler) -> None:
        scheduled = [sch for sch in out.scheduled if sch.num_spec_slots]
        if not scheduled:
            return
        t0 = time.perf_counter()
        batch = [DraftRequest(sch.request, sch.seq, sch.start, sch.num_spec_slots) for sch in scheduled]
        proposal = self.proposer.propose(batch)
        for sch, drafts in zip(scheduled, proposal.drafts):
            drafts = list(drafts[:sch.num_spec_slots])
            scheduler.shrink_spec(sch, len(drafts))
            sch.spec_token_ids = drafts
        out.spec = SpecBatch(proposal.probs, {sch.seq.seq_id: i for i, sch in enumerate(scheduled)})
        self.stats.draft_s += time.perf_counter() - t0

    # ---- 3. after the step ---------------------------------------------------------------------

    @staticmethod
    def verifies(out: SchedulerOutput) -> bool:
        """Whether a scheduled step has drafts to verify (its results decide the next schedule)."""
        return out.spec is not None and any(sch.spec_token_ids for sch in out.scheduled)

    def observe(self, out: SchedulerOutput, sampled: dict[int, list[int]], seconds: float,
                planned_at: float, representative: bool = True, attempted: bool = False) -> None:
        """A step's results: acceptance statistics, and the policy's measurement (`planned_at`:
        when the step's plan began; `representative`: false for a plain step that filled the
        async pipeline; `attempted`: the step was planned to speculate, drafts or not)."""
        self._measure(out, sampled, planned_at, representative, attempted)
        verified = False
        stats = self.stats
        for sch in out.scheduled:
            if not sch.spec_token_ids or sch.seq.seq_id not in sampled:
                continue
            verified = True
            accepted = len(sampled[sch.seq.seq_id]) - 1
            stats.num_drafts += 1
            stats.num_draft_tokens += len(sch.spec_token_ids)
            stats.num_accepted_tokens += accepted
            for i in range(accepted):
                stats.accepted_per_pos[i] += 1
        if verified:
            stats.verify_s += seconds

    def _measure(self, out: SchedulerOutput, sampled: dict[int, list[int]], planned_at: float,
                 representative: bool, attempted: bool) -> None:
        """The step for the policy: decode rows only, whether any drafted, tokens per sequence."""
        decode_only = all(sch.num_new_tokens == 1 + len(sch.spec_token_ids or ()) for sch in out.scheduled)
        gained = [len(sampled.get(sch.seq.seq_id, ())) for sch in out.scheduled]
        # A step planned to speculate is the speculating side even when the proposer found no
        # drafts: it ran synchronously all the same, and proposing cost its time.
        speculated = attempted or any(sch.spec_token_ids for sch in out.scheduled)
        tokens = sum(gained) / len(gained) if gained else 0.0
        self.policy.step_ran(len(out.scheduled), speculated, tokens, decode_only, planned_at,
                             representative or speculated)
