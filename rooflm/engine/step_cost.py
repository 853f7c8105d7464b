"""The engine's own step-cost model, measured as it runs: what SLO-aware admission predicts a
request's queueing time from (serving_loop.admission_check) and the predicted-wait gauge shows.

Why measured online and not the simulator's calibration (sim/calibration.py): the engine may
not import sim or perf (they sit above it), a calibration table exists only for the GPUs and
model shapes someone calibrated (one today), and it prices a step from a roofline of the model
while the engine can simply time the steps it runs, on this device, with this model, batch
mix, quantization and load. Two exponentially weighted averages over the StepReports the
engine already produces are enough for a queueing estimate:

  decode_step_s    wall time of a step without prefill tokens (the running batch's decode);
  prefill_token_s  the rest of a step with prefill tokens, per prefill token.

The prediction for a request that arrives now (predict_queue_wait):

  prefill-bound  the waiting requests ahead of it (all of them under fcfs; those of a lower or
                 equal (priority, arrival) under priority) hold T uncomputed prompt tokens; a
                 step computes at most P = max_num_batched_tokens - running decodes of them, so
                 they clear in ceil(T / P) steps: ceil(T / P) decode_step_s + T prefill_token_s.
  capacity-bound when the last admission stopped for lack of KV blocks or sequence slots, the
                 queue advances one request per running request that finishes: the k-th
                 request ahead starts when the (k+1)-th running request ends. A running
                 request is expected to end after its expected output (the share of max_tokens
                 that finished requests used, growth_reserve.NewTokenRatio) less what it has
                 produced; beyond the running set, each further round of requests takes a mean
                 expected output. Under priority a request that may preempt a running one of
                 lower priority does not wait for capacity.

SLO-aware admission weighs more than the queueing time: the budget is a time to first token.
predict_ttft adds what comes after the queue: the request's own prompt (its prefill takes steps
like the tokens ahead of it; prefix hits are not looked up, so a cached prompt is priced whole),
and with async scheduling the step already launched, which a new request cannot join: it runs
first (step_s, the average wall time of any step). The chunks of prompts already running count
among the tokens ahead (under priority only those of requests that outrank it: the others leave
it the budget, scheduler._Outranking). Without these the check let through requests that then
missed their budget by two steps (a 1.5x overload, simulated: admitted requests' median TTFT
561 ms against a 500 ms budget).

Before the first measured step the prediction is 0: nothing is shed on a guess.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from rooflm.engine.growth_reserve import CLIP_TOKENS, INIT_RATIO
from rooflm.engine.report import StepReport

if TYPE_CHECKING:
    from rooflm.engine.request import Request
    from rooflm.engine.scheduler import Scheduler

# Weight of the newest step in the averages: about the last ten steps count, so the estimate
# follows a batch that grows or shrinks within a fraction of a second on a GPU.
EWMA_WEIGHT = 0.2


def _ewma(old: Optional[float], new: float) -> float:
    return new if old is None else old + EWMA_WEIGHT * (new - old)


@dataclass
class StepCostEstimator:
    """Step costs measured from the engine's own steps (an observer of its StepReports)."""

    decode_step_s: Optional[float] = None
    prefill_token_s: Optional[float] = None
    num_observed: int = 0
    step_s: Optional[float] = None  # any step's wall time, prefill or not: the step in flight
    # The running batch's share of a prediction (its decodes, and per priority its prompt
    # chunks) read once per schedule, not once per request weighed: with a thousand running
    # requests and tens of arrivals a step, the scan cost a millisecond each.
    _running_memo: tuple = field(default=(), repr=False, compare=False)
    _running_values: dict = field(default_factory=dict, repr=False, compare=False)

    def observe(self, report: StepReport) -> None:
        elapsed = report.timings.elapsed_s
        if elapsed <= 0.0:
            return
        self.num_observed += 1
        self.step_s = _ewma(self.step_s, elapsed)
        tokens = report.shape.prefill_tokens
        if tokens == 0:
            self.decode_step_s = _ewma(self.decode_step_s, elapsed)
            return
        # Before any decode-only step the whole step counts per token: an overestimate, which
        # errs on the side of the budget.
        base = self.decode_step_s or 0.0
        self.prefill_token_s = _ewma(self.prefill_token_s, max(elapsed - base, 0.0) / tokens)

    @property
    def measured(self) -> bool:
        return self.num_observed > 0

    def steps_s(self, num_steps: float, prefill_tokens: int) -> float:
        return num_steps * (self.decode_step_s or 0.0) + prefill_tokens * (self.prefill_token_s or 0.0)


def predict_queue_wait(sched: "Scheduler", cost: StepCostEstimator, priority: int = 0,
                       arrival: float = math.inf) -> float:
    """Seconds until a request of this priority arriving at `arrival` is first scheduled (the
    module docstring's model); 0 before any step was measured."""
    if not cost.measured:
        return 0.0
    return _wait(sched, cost, (priority, arrival), 0)


def predict_ttft(sched: "Scheduler", cost: StepCostEstimator, prompt_tokens: int, priority: int = 0,
                 arrival: float = math.inf, step_in_flight: bool = False) -> float:
    """Seconds from now to the first token of a request of prompt_tokens tokens, admitted now
    (the module docstring's model); 0 before any step was measured."""
    if not cost.measured:
        return 0.0
    ttft = _wait(sched, cost, (priority, arrival), prompt_tokens)
    if step_in_flight:
        ttft += cost.step_s or 0.0
    return ttft


def _wait(sched: "Scheduler", cost: StepCostEstimator, key: tuple[int, float], own_tokens: int) -> float:
    """Until the prefill tokens ahead of a request of this key, and then own_tokens of its own,
    are computed; plus, when admission is capacity-bound, until it gets a slot."""
    ahead = [r for r in sched.waiting if not sched.by_priority or r.schedule_key <= key]
    decodes, chunks = _running_share(sched, cost, key)
    tokens = sum(_uncomputed_prompt(r) for r in ahead) + chunks + own_tokens
    per_step = max(1, sched.cfg.max_num_batched_tokens - decodes)
    steps = math.ceil(tokens / per_step)
    if own_tokens and steps > 1:
        # Its prompt ends in the last of these steps, which requests arriving meanwhile fill up:
        # a full step, not the part of one its own tokens take.
        tokens = max(tokens, steps * per_step)
    wait = cost.steps_s(steps, tokens)
    if sched.capacity_blocked and not _may_preempt(sched, key):
        wait += cost.steps_s(_steps_until_admitted(sched, len(ahead) + len(sched.swapped)), 0)
    return wait


def _uncomputed_prompt(req: "Request") -> int:
    return max((s.num_tokens - s.num_computed_tokens for s in req.live_seqs), default=0)


def _running_share(sched: "Scheduler", cost: StepCostEstimator, key: tuple[int, float]) -> tuple[int, int]:
    """(running sequences, their prompt chunks ahead of key), memoized until the scheduler runs
    again or a running request leaves. Under priority the chunks depend on the key's priority
    only: running requests arrived before any request being weighed now."""
    state = (sched, sched.num_schedules, len(sched.running))  # the scheduler itself: ids are reused
    if cost._running_memo != state:
        cost._running_memo = state
        cost._running_values = {"decodes": sched.num_running_seqs()}
    values = cost._running_values
    chunk_key = key[0] if sched.by_priority else None
    if chunk_key not in values:
        values[chunk_key] = _running_chunks(sched, key)
    return values["decodes"], values[chunk_key]


def _running_chunks(sched: "Scheduler", key: tuple[int, float]) -> int:
    """Prompt tokens that running requests ahead still have to compute (a chunked prompt's
    rest); a decode's one token is in the per-step decode count instead."""
    tokens = 0
    by_priority = sched.by_priority
    for req in sched.running:  # up to max_num_seqs of them, for every admission weighed: kept lean
        if by_priority and req.schedule_key > key:
            break  # the running list is in key order; the rest leave it their budget
        left = 0
        for seq in req.seqs:
            if seq.num_computed_tokens + 1 < seq.num_prompt_tokens and seq.finish_reason is None:
                left = max(left, seq.num_tokens - seq.num_computed_tokens)
        tokens += left
    return tokens


def _may_preempt(sched: "Scheduler", key: tuple[int, float]) -> bool:
    return sched.by_priority and any(r.schedule_key > key for r in sched.running)


def _expected_output(req: "Request", share: float) -> float:
    return max(1.0, share * min(req.max_tokens, CLIP_TOKENS))


def _steps_until_admitted(sched: "Scheduler", num_ahead: int) -> float:
    """Decode steps until the request behind num_ahead others gets a slot, at one admission per
    running request that ends."""
    running = sched.running
    if not running:
        return 0.0
    ratio = sched.new_token_ratio
    share = INIT_RATIO if ratio.used_share is None else ratio.used_share
    def left(req: "Request") -> float:
        produced = max((s.num_output_tokens + s.num_pending for s in req.live_seqs), default=0)
        return max(1.0, _expected_output(req, share) - produced)
    if num_ahead < len(running):
        return heapq.nsmallest(num_ahead + 1, (left(r) for r in running))[-1]
    mean_output = sum(_expected_output(r, share) for r in running) / len(running)
    rounds = math.ceil((num_ahead + 1 - len(running)) / len(running))
    return max(left(r) for r in running) + rounds * mean_output
