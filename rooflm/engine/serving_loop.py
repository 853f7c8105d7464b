"""What the two loops that run an LLMEngine for a server share: the engine thread of the
in-process front end (async_engine.py) and the engine-core process (core.py).

Each loop owns its engine alone and, between steps, applies what its front end
sent: groups of requests (admission_check, then add_group: all or nothing) and
aborts. Then it runs one step (CountedSteps) and hands out the outputs.

Test hook: the environment variable ROOFLM_FAULT_INJECT_STEP=N makes the N-th
call to engine.step() (counted from 1 since the loop started, the server's
warm-up generation included) raise RuntimeError instead of running. It exists
so tests can check the failure path; never set it in production.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Optional

import rooflm.envs as envs
from rooflm.engine.outputs import RequestOutput
from rooflm.engine.request import Request
from rooflm.engine.request_types import AdmissionLimits, AdmissionRejected, GenerateRequest

logger = logging.getLogger(__name__)

FAULT_INJECT_ENV = "ROOFLM_FAULT_INJECT_STEP"

# How long an idle loop waits for a command before it checks in (updates its heartbeat).
# Small enough for a fresh health signal, large enough to cost nothing.
IDLE_TICK_S = 0.25

# When the scheduler has work but schedules nothing (every waiting request is blocked on
# KV blocks), back off this long instead of spinning a core.
EMPTY_STEP_BACKOFF_S = 0.01


def fault_step_from_env() -> Optional[int]:
    step = envs.get(FAULT_INJECT_ENV)
    if step is None:
        return None
    logger.warning("%s=%d: engine step %d will raise (test hook)", FAULT_INJECT_ENV, step, step)
    return step


class CountedSteps:
    """engine.step(), counted for the fault-injection test hook (module docstring)."""

    def __init__(self, fault_inject_step: Optional[int]):
        self.fault_inject_step = fault_inject_step
        self.num_calls = 0

    def run(self, engine) -> tuple[list[RequestOutput], bool]:
        """One engine step: its outputs, and whether it did any work (a step whose every
        waiting request is short of KV blocks schedules nothing)."""
        self.num_calls += 1
        if self.fault_inject_step is not None and self.num_calls == self.fault_inject_step:
            raise RuntimeError(f"fault injected at engine step {self.num_calls} "
                               f"({FAULT_INJECT_ENV})")
        steps_before = engine.num_steps
        outputs = engine.step()
        return outputs, engine.num_steps != steps_before


def admission_check(engine, limits: AdmissionLimits, tokens_in_flight: int,
                    requests: list[GenerateRequest]) -> Optional[AdmissionRejected]:
    """Why a group of requests may not be admitted now (None: it may). Runs where the engine
    is (its thread, or the engine-core process), against the live queue. Raises
    InvalidRequest for a priority the engine would refuse, before it is weighed."""
    if engine.is_sleeping:
        return AdmissionRejected("the engine is sleeping (sleep mode): POST /wake_up wakes it; "
                                 "retry later", status=503, code="sleeping")
    # The live queue, not a published snapshot: requests admitted earlier in this same
    # batch of commands are waiting already.
    waiting = engine.snapshot().num_waiting_reqs
    limit = limits.max_queued_requests
    if waiting + len(requests) > limit:
        return AdmissionRejected(f"the server is overloaded: {waiting} requests are waiting "
                                 f"(limit {limit}); retry later")
    cap = limits.max_tokens_in_flight
    reserved = sum(r.reserved_tokens for r in requests)
    if cap and tokens_in_flight + reserved > cap:
        return AdmissionRejected(f"the server is overloaded: {tokens_in_flight} tokens in "
                                 f"flight plus this request's {reserved} would pass the limit of "
                                 f"{cap}; retry later")
    return slo_check(engine, limits, requests)


def slo_check(engine, limits: AdmissionLimits, requests: list[GenerateRequest]) -> Optional[AdmissionRejected]:
    """SLO-aware admission: a request whose time since arrival plus predicted time to first
    token from now (queueing, its own prefill and the step in flight, from the engine's
    measured step costs: step_cost.predict_ttft) already exceeds its TTFT budget (its
    deadline_ms, else the server's ttft_slo_ms) is refused now with 503, before any prefill,
    instead of timing out after it used capacity. Retry-After: the predicted wait."""
    now = time.monotonic()
    for request in requests:
        engine.check_priority(request.priority)
        budget_ms = request.deadline_ms if request.deadline_ms is not None else limits.ttft_slo_ms
        if not budget_ms:
            continue
        wait = engine.predicted_ttft(len(request.prompt_token_ids), request.priority, request.arrival_time)
        waited = max(now - request.arrival_time, 0.0)
        if waited + wait > budget_ms / 1000:
            return AdmissionRejected(
                f"the request cannot start within its time-to-first-token budget of "
                f"{budget_ms:g} ms: its predicted time to first token is {wait * 1000:.0f} ms (after "
                f"{waited * 1000:.0f} ms since arrival); retry later",
                status=503, retry_after_s=max(1, math.ceil(wait)), code="slo_shed")
    return None


def add_group(engine, requests: list[GenerateRequest]) -> list[Request]:
    """Add a group of requests to the engine all or nothing: a group with one bad prompt queues
    none of its prompts (the error propagates)."""
    added: list[Request] = []
    try:
        for request in requests:
            added.append(engine.add_request(
                request.request_id, request.prompt_token_ids, request.params,
                arrival_time=request.arrival_time, cache_salt=request.cache_salt,
                priority=request.priority, lora_request=request.lora_request))
    except Exception:
        if added:
            engine.abort_request([r.request_id for r in added])
        raise
    return added
