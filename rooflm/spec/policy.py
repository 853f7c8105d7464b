"""When speculating pays: measured tokens per second of speculating and plain steps, per batch size.

Drafts are free only while the verify forward stays memory-bound and the proposer costs little.
Neither holds everywhere: on the H100 (2026-11-25, benchmarks/results/spec-h100-20261125/) a 1B
draft model at batch 64 made decoding 0.57x as fast at 80% acceptance, and real n-gram drafts on
text they do not match cost 0.93x at batch 1. The token budget (decoder.py) bounds k by the
GEMMs' ridge point; this policy decides, per step, between speculating with that k and not
speculating, from what the engine has measured:

    speculate  iff  L_spec / t_spec  >  1 / t_plain

for the step's batch-size bucket (powers of two), where t is a step's period (from the previous
step's results to this one's, so schedule, propose, forward, sampling and output processing all
count) and L_spec the tokens a sequence gained per speculating step (accepted drafts + 1,
sequences without drafts counting 1). All three are exponential moving averages.

Under async scheduling plain steps overlap the host's work with the device's, while a
speculating step runs synchronously (its proposals need the previous step's tokens on the host).
A plain step's period is representative only once the pipeline is full: the first plain step
after a synchronous one is not measured, so plain steps are tried in runs (explore_plain_steps).

A bucket learns first: it runs plain steps until min_plain_steps are measured, then speculates
until min_spec_steps speculating steps are measured (a step counts as speculating when it was
planned to, even if the proposer found no drafts: such a step still ran synchronously), or
until two are and they ran at under early_exit of plain's rate (a draft model at a large batch:
learning it longer only costs). Then it keeps the faster side and now and then runs a short
stretch of the other (one speculating step, or explore_plain_steps plain ones), so its figures
follow changes in acceptance (a chat turning into a copy task) and in context length. The gap
from a decision to the next stretch is explore_every steps, or more where a stretch costs more
than explore_budget of the steps in between (a stretch of a side at a third of the other's rate
costs two steps); each stretch that leaves the decision as it was doubles the gap (up to
max_explore_gap), a flip resets it: a losing side that stays losing costs ever less. Seeded
random requests and --deterministic keep the budget's choice (decoder.py): a timing-driven
choice would change their outputs run to run.

policy "budget" keeps the token budget alone (always speculate when k > 0).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional


def _rate(side: "_Side") -> float:
    """Tokens per second per sequence of one side (a zero period, a coarse clock's, counts as 1 ns)."""
    return side.tokens / max(side.seconds, 1e-9)


def bucket(batch: int) -> int:
    """Batch sizes share measurements within powers of two: 1, 2, 3-4, 5-8, ..."""
    return 1 << max(0, (batch - 1).bit_length())


@dataclass
class _Side:
    seconds: Optional[float] = None  # EWMA of a step's period (results to results)
    tokens: Optional[float] = None  # EWMA of tokens a sequence gained per step (plain: 1)
    count: int = 0  # steps measured


@dataclass
class _Bucket:
    spec: _Side = field(default_factory=_Side)
    plain: _Side = field(default_factory=_Side)
    steps: int = 0
    run_side: bool = False  # the side an exploring run tries (True: speculate)
    run_left: int = 0  # steps of that run still to go
    explored: Optional[bool] = None  # the decision an exploring run was started against
    gap: int = 0  # steps from a decision to the next exploring run
    next_explore: Optional[int] = None  # the bucket's step that starts it
    decision: Optional[bool] = None  # the side last chosen (True: speculate)


class SpecPolicy:
    def __init__(self, mode: str = "adaptive", decay: float = 0.8, explore_every: int = 32,
                 min_spec_steps: int = 4, min_plain_steps: int = 2, explore_plain_steps: int = 3,
                 max_explore_gap: int = 512, explore_budget: float = 0.01, early_exit: float = 0.5,
                 clock=time.perf_counter):
        if mode not in ("adaptive", "budget"):
            raise ValueError(f"speculative_policy must be adaptive or budget, got {mode!r}")
        self.mode = mode
        self.decay = decay
        self.explore_every = explore_every
        self.min_spec_steps = min_spec_steps
        self.min_plain_steps = min_plain_steps
        self.explore_plain_steps = explore_plain_steps
        self.max_explore_gap = max_explore_gap
        self.explore_budget = explore_budget
        self.early_exit = early_exit
        self.clock = clock
        self.buckets: dict[int, _Bucket] = {}
        self.last_done: Optional[float] = None  # when the previous step's results arrived

    # ---- deciding (SpecDecoder.plan) ----------------------------------------------------------

    def speculate(self, batch: int) -> bool:
        """Whether this step of `batch` decoding sequences speculates (k from the budget > 0)."""
        if self.mode == "budget":
            return True
        b = self.buckets.setdefault(bucket(batch), _Bucket())
        b.steps += 1
        if b.run_left > 0:  # an exploring run of one side
            b.run_left -= 1
            return b.run_side
        if b.plain.count < self.min_plain_steps:
            return False
        if self._learning_spec(b):
            return True
        better = self.speculating_pays(b)
        if b.next_explore is None or b.explored is not None or better != b.decision:
            # Decided for the first time, a stretch just ended, or the figures flipped the
            # decision: a stretch that changed nothing doubles the gap, anything else resets it.
            confirmed = b.explored is not None and better == b.explored
            floor = self._gap_floor(b, better)
            b.gap = min(max(2 * b.gap, floor) if confirmed else floor, self.max_explore_gap)
            b.explored, b.next_explore = None, b.steps + b.gap
        b.decision = better
        if b.steps >= b.next_explore:
            b.explored, b.run_side = better, not better
            b.run_left = (1 if b.run_side else self.explore_plain_steps) - 1
            return b.run_side
        return better

    def _learning_spec(self, b: _Bucket) -> bool:
        if b.spec.count >= self.min_spec_steps:
            return False
        return b.spec.count < 2 or _rate(b.spec) >= self.early_exit * _rate(b.plain)

    def _gap_floor(self, b: _Bucket, better: bool) -> int:
        """Steps between stretches so that one costs at most explore_budget of them: a stretch
        of the losing side costs its length x (winner's rate / loser's rate - 1) steps."""
        win, lose = (b.spec, b.plain) if better else (b.plain, b.spec)
        length = self.explore_plain_steps if better else 1
        cost = length * max(0.0, _rate(win) / max(_rate(lose), 1e-9) - 1.0)
        return max(self.explore_every, math.ceil(cost / self.explore_budget))

    @staticmethod
    def speculating_pays(b: _Bucket) -> bool:
        return _rate(b.spec) > _rate(b.plain)

    # ---- measuring (SpecDecoder.observe) ------------------------------------------------------

    def step_ran(self, batch: int, speculated: bool, tokens_per_seq: float, decode_only: bool,
                 planned_at: float, representative: bool = True) -> None:
        """A step's results arrived. Its period runs from the previous step's results, or from
        its own plan if that came later (the engine was idle). Steps with prefill chunks are not
        measured (their time is the prefill's), nor unrepresentative ones (a plain step that
        filled the async pipeline)."""
        now = self.clock()
        started = planned_at if self.last_done is None else max(self.last_done, planned_at)
        self.last_done = now
        if self.mode == "budget" or not decode_only or batch == 0 or not representative:
            return
        b = self.buckets.setdefault(bucket(batch), _Bucket())
        side = b.spec if speculated else b.plain
        side.seconds = self._ewma(side.seconds, now - started)
        side.tokens = self._ewma(side.tokens, tokens_per_seq)
        side.count += 1

    def _ewma(self, old: Optional[float], new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def summary(self) -> dict[int, dict[str, Optional[float]]]:
        """Per bucket: tokens per second per sequence, speculating and plain (for logs and benches)."""
        out = {}
        for key, b in sorted(self.buckets.items()):
            out[key] = {name: (side.tokens / side.seconds if side.seconds else None)
                        for name, side in (("spec", b.spec), ("plain", b.plain))}
        return out
