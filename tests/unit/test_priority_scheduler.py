"""--scheduling-policy priority on the scheduler alone: admission order, preemption order. No
model, no device; exact orders (vLLM's semantics: lower priority value first, ties by arrival)."""

import itertools

import pytest

from rooflm.config import SchedulerConfig
from rooflm.engine.block_manager import BlockManager
from rooflm.engine.request import Request, RequestStatus, Sequence
from rooflm.engine.scheduler import Scheduler
from rooflm.sampling_params import SamplingParams

_seq_ids = itertools.count()


def make_request(rid: str, prompt_len: int, priority: int = 0, arrival: float = 0.0,
                 max_tokens: int = 8) -> Request:
    base = 1000 * (sum(map(ord, rid)) % 50)  # distinct prompts: no prefix hits between requests
    ids = list(range(base, base + prompt_len))
    req = Request(rid, None, ids, SamplingParams(max_tokens=max_tokens, temperature=0), max_tokens,
                  arrival_time=arrival, priority=priority)
    req.seqs.append(Sequence(next(_seq_ids), 0, list(ids), prompt_len))
    return req


def run_step(sched: Scheduler):
    out = sched.schedule()
    for s in out.scheduled:
        if s.completes:
            s.seq.append_token(7)
    return out


def scheduler(policy: str, num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 64) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          scheduling_policy=policy, reserve_new_tokens=False)
    return Scheduler(cfg, BlockManager(num_blocks, 4))


def admitted(out) -> list[str]:
    return [s.request.request_id for s in out.scheduled if s.start == 0]


def test_priority_admits_lower_values_first_ties_by_arrival():
    sched = scheduler("priority", budget=8)  # one 8-token prompt a step
    for rid, priority, arrival in [("a", 2, 1.0), ("b", 0, 2.0), ("c", 1, 3.0), ("d", 0, 4.0)]:
        sched.add(make_request(rid, 8, priority, arrival))
    order = []
    for _ in range(4):
        order += admitted(run_step(sched))
    assert order == ["b", "d", "c", "a"]


def test_fcfs_keeps_arrival_order_whatever_the_priority():
    sched = scheduler("fcfs", budget=8)
    for rid, priority, arrival in [("a", 2, 1.0), ("b", 0, 2.0), ("c", 1, 3.0)]:
        sched.add(make_request(rid, 8, priority, arrival))
    order = []
    for _ in range(3):
        order += admitted(run_step(sched))
    assert order == ["a", "b", "c"]


def test_a_higher_priority_arrival_preempts_the_lowest_priority_latest_running_first():
    # 6 blocks of 4 tokens; three low-priority requests hold 2 blocks each: the pool is full.
    sched = scheduler("priority", num_blocks=6)
    low = [make_request("x", 8, 5, 1.0), make_request("y", 8, 7, 2.0), make_request("z", 8, 7, 3.0)]
    for req in low:
        sched.add(req)
    run_step(sched)
    assert [r.request_id for r in sched.running] == ["x", "y", "z"]
    assert sched.num_free_blocks == 0
    urgent = make_request("urgent", 8, 0, 4.0)  # needs 2 blocks; its decodes need more later
    sched.add(urgent)
    out = run_step(sched)
    # Lowest priority first (7 before 5), and of the two 7s the later arrival first.
    assert [r.request_id for r in out.preempted] == ["z", "y"]
    assert "urgent" in admitted(out)
    assert [r.request_id for r in sched.running] == ["urgent", "x"]
    # The victims wait in priority order again, behind nothing of higher priority.
    assert [r.request_id for r in sched.waiting] == ["y", "z"]
    assert all(r.status == RequestStatus.WAITING for r in low[1:])


def test_equal_priority_never_preempts_an_earlier_arrival():
    sched = scheduler("priority", num_blocks=6)  # two prompts and their next blocks: full
    for rid, arrival in [("a", 1.0), ("b", 2.0)]:
        sched.add(make_request(rid, 8, 3, arrival))
    run_step(sched)
    sched.add(make_request("c", 8, 3, 3.0))
    out = run_step(sched)
    assert out.preempted == []
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_fcfs_never_preempts_for_a_waiting_request():
    sched = scheduler("fcfs", num_blocks=6)
    for rid, priority, arrival in [("a", 9, 1.0), ("b", 9, 2.0)]:
        sched.add(make_request(rid, 8, priority, arrival))
    run_step(sched)
    sched.add(make_request("c", 8, 0, 3.0))
    out = run_step(sched)
    assert out.preempted == []
    assert admitted(out) == []


@pytest.mark.parametrize("policy,victim", [("fcfs", "b"), ("priority", "a")])
def test_running_out_of_blocks_preempts_by_policy(policy, victim):
    """Decodes outgrow the pool: FCFS preempts the latest admitted request; priority the
    lowest-priority one, although it was admitted first."""
    sched = scheduler(policy, num_blocks=4)
    sched.add(make_request("a", 8, 9, 1.0))  # low priority, admitted first
    sched.add(make_request("b", 8, 0, 2.0))
    run_step(sched)  # both prompts: 4 blocks, all full
    out = run_step(sched)  # each decode opens a block: one request must go
    assert [r.request_id for r in out.preempted] == [victim]
