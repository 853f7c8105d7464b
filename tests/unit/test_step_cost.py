"""engine/step_cost.py: the measured step costs and the queueing prediction, on exact numbers.
No model, no device."""

import math

from rooflm.engine.report import BatchShape, StepReport, StepTimings
from rooflm.engine.step_cost import EWMA_WEIGHT, StepCostEstimator, predict_queue_wait, predict_ttft
from tests.unit.test_priority_scheduler import make_request, run_step, scheduler


def _report(elapsed_s: float, prefill_tokens: int = 0, decodes: int = 1) -> StepReport:
    return StepReport(1, BatchShape(num_decode_seqs=decodes, prefill_tokens=prefill_tokens), decodes,
                      0, "eager", StepTimings(elapsed_s=elapsed_s))


def test_the_averages_follow_decode_steps_and_prefill_tokens():
    cost = StepCostEstimator()
    assert not cost.measured
    cost.observe(_report(0.010))
    assert cost.decode_step_s == 0.010
    cost.observe(_report(0.020))
    assert math.isclose(cost.decode_step_s, 0.010 + EWMA_WEIGHT * 0.010)
    cost.observe(_report(0.012 + 0.100, prefill_tokens=100))  # the decode part, then 1 ms a token
    assert math.isclose(cost.prefill_token_s, (0.112 - cost.decode_step_s) / 100)


def test_nothing_is_predicted_before_a_measured_step():
    sched = scheduler("fcfs", budget=8)
    sched.add(make_request("a", 8))
    assert predict_queue_wait(sched, StepCostEstimator()) == 0.0


def test_prefill_bound_wait_counts_the_tokens_ahead_and_their_steps():
    sched = scheduler("fcfs", budget=8)
    for rid in ("a", "b", "c"):
        sched.add(make_request(rid, 8, arrival=1.0))
    cost = StepCostEstimator(decode_step_s=0.01, prefill_token_s=0.001, num_observed=1)
    # 24 tokens ahead at 8 a step: 3 steps and 24 tokens.
    assert math.isclose(predict_queue_wait(sched, cost), 3 * 0.01 + 24 * 0.001)


def test_under_priority_only_the_requests_ahead_count():
    sched = scheduler("priority", budget=8)
    sched.add(make_request("low", 8, priority=5, arrival=1.0))
    sched.add(make_request("high", 8, priority=0, arrival=2.0))
    cost = StepCostEstimator(decode_step_s=0.01, prefill_token_s=0.0, num_observed=1)
    assert math.isclose(predict_queue_wait(sched, cost, priority=0, arrival=3.0), 0.01)  # "high"
    assert math.isclose(predict_queue_wait(sched, cost, priority=9, arrival=3.0), 0.02)
    assert predict_queue_wait(sched, cost, priority=-1, arrival=3.0) == 0.0


def test_a_capacity_bound_queue_waits_for_running_requests_to_end():
    # One sequence slot: "a" runs (max_tokens 10, 1 produced), "b" waits for the slot.
    sched = scheduler("fcfs", max_num_seqs=1, budget=64)
    sched.add(make_request("a", 8, arrival=1.0, max_tokens=10))
    run_step(sched)
    sched.add(make_request("b", 8, arrival=2.0))
    run_step(sched)
    assert sched.capacity_blocked
    cost = StepCostEstimator(decode_step_s=0.01, prefill_token_s=0.0, num_observed=1)
    # "a" is expected to produce 0.7 x 10 tokens (no request finished yet: growth_reserve's
    # INIT_RATIO) and has produced 2 (pending included): 5 more steps before "b" starts, one
    # more step for b's prompt, then a full expected output for "b" before a newcomer starts.
    produced = sched.running[0].seqs[0].num_output_tokens + sched.running[0].seqs[0].num_pending
    left = 0.7 * 10 - produced
    assert math.isclose(predict_queue_wait(sched, cost), (1 + left + 0.7 * 10) * 0.01)


# ---- predict_ttft: what SLO-aware admission weighs ------------------------------------------------


def test_the_ttft_adds_the_own_prompt_and_the_step_in_flight():
    sched = scheduler("fcfs", budget=8)
    sched.add(make_request("a", 4, arrival=1.0))
    cost = StepCostEstimator(decode_step_s=0.01, prefill_token_s=0.001, num_observed=1, step_s=0.05)
    # 4 tokens ahead and 4 of its own fit one step: one step, 8 tokens; then the step in flight.
    assert math.isclose(predict_ttft(sched, cost, 4), 0.01 + 8 * 0.001)
    assert math.isclose(predict_ttft(sched, cost, 4, step_in_flight=True), 0.01 + 8 * 0.001 + 0.05)
    assert predict_ttft(sched, StepCostEstimator(), 4, step_in_flight=True) == 0.0


def test_the_ttft_prices_the_last_of_several_steps_full():
    sched = scheduler("fcfs", budget=8)
    sched.add(make_request("a", 8, arrival=1.0))
    cost = StepCostEstimator(decode_step_s=0.01, prefill_token_s=0.001, num_observed=1)
    # 8 ahead and 4 of its own: 2 steps; requests arriving meanwhile fill the second.
    assert math.isclose(predict_ttft(sched, cost, 4), 2 * 0.01 + 16 * 0.001)


def test_running_prompt_chunks_count_ahead_unless_they_yield_under_priority():
    cost = StepCostEstimator(decode_step_s=0.0, prefill_token_s=0.001, num_observed=1)
    for policy, expected in [("fcfs", 40 - 32 + 4), ("priority", 4)]:
        sched = scheduler(policy, budget=32)
        sched.add(make_request("long", 40, priority=0 if policy == "fcfs" else 5, arrival=1.0))
        run_step(sched)  # its first chunk of 32
        # fcfs: the 8 tokens left of the running prompt go first; priority: a request that
        # outranks it takes the budget before them (scheduler._Outranking).
        assert math.isclose(predict_ttft(sched, cost, 4, priority=0, arrival=2.0), expected * 0.001), policy


def test_the_running_share_is_read_again_after_each_schedule():
    cost = StepCostEstimator(decode_step_s=0.0, prefill_token_s=0.001, num_observed=1)
    sched = scheduler("fcfs", budget=64)
    sched.add(make_request("long", 100, arrival=1.0))
    run_step(sched)  # 64 of 100
    assert math.isclose(predict_ttft(sched, cost, 4), (36 + 4) * 0.001)
    assert math.isclose(predict_ttft(sched, cost, 4), (36 + 4) * 0.001)  # memoized, the same
    run_step(sched)  # the rest: it decodes now
    assert math.isclose(predict_ttft(sched, cost, 4), 4 * 0.001)
