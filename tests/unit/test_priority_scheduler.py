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


# ---- a high-priority arrival under load: steps to its first token ----------------------------


def _loaded(policy: str, max_num_seqs: int = 6, budget: int = 16, num_decodes: int = 4):
    """A batch of low-priority requests: decodes, and one long prompt whose chunks take the
    rest of every step's budget (by default one sequence slot stays free)."""
    sched = scheduler(policy, num_blocks=256, max_num_seqs=max_num_seqs, budget=budget)
    for i in range(num_decodes):
        sched.add(make_request(f"d{i}", 2, 9, float(i), max_tokens=64))
    run_step(sched)  # the short prompts: decoding from now on
    sched.add(make_request("long", 96, 9, 10.0, max_tokens=64))
    run_step(sched)  # its first chunk
    return sched


def _steps_to_first_token(sched: Scheduler, rid: str, limit: int = 20) -> int:
    for steps in range(1, limit + 1):
        out = run_step(sched)
        if any(s.request.request_id == rid and s.completes for s in out.scheduled):
            return steps
    raise AssertionError(f"{rid} sampled no token in {limit} steps")


def test_a_high_priority_prompt_takes_the_budget_before_lower_priority_chunks():
    sched = _loaded("priority")
    sched.add(make_request("urgent", 8, 0, 20.0))
    out = run_step(sched)
    tokens = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
    # Its whole prompt in the step it arrived for; the decodes keep their token; the chunk of
    # the long low-priority prompt gets what is left of the 16 tokens.
    assert tokens["urgent"] == 8
    assert all(tokens[f"d{i}"] == 1 for i in range(4))
    assert tokens["long"] == 16 - 8 - 4


@pytest.mark.parametrize("max_num_seqs,waiting_decodes", [(7, ["d2", "d3"]), (6, [])])
def test_low_priority_decodes_wait_a_step_only_when_higher_priority_prompts_fill_the_budget(
        max_num_seqs, waiting_decodes):
    """With slots for both arrivals their 14 prompt tokens of the 16 leave room for two of the
    four decodes (the earlier arrivals go first); with one slot the second arrival cannot start
    this step, so it holds nothing and every decode runs."""
    sched = _loaded("priority", max_num_seqs=max_num_seqs)  # 5 running
    sched.add(make_request("u1", 8, 0, 20.0))
    sched.add(make_request("u2", 6, 0, 21.0))
    out = run_step(sched)
    tokens = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
    assert tokens["u1"] == 8
    assert ("u2" in tokens) == bool(waiting_decodes)
    assert [f"d{i}" for i in range(4) if f"d{i}" not in tokens] == waiting_decodes
    out = run_step(sched)  # the decodes left out run in the next step
    assert {f"d{i}" for i in range(4)} <= {s.request.request_id for s in out.scheduled}


def test_under_fcfs_running_chunks_still_go_first():
    """The fcfs order is unchanged: the long prompt's chunk takes the budget, the arrival waits."""
    sched = _loaded("fcfs")
    sched.add(make_request("later", 8, 0, 20.0))
    out = run_step(sched)
    tokens = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
    assert tokens["long"] == 16 - 4
    assert "later" not in tokens


@pytest.mark.parametrize("max_num_seqs", [6, 5])
def test_a_high_priority_arrival_into_a_full_batch_samples_within_one_step(max_num_seqs):
    """With a free slot, and at the sequence cap (5: the long prompt fills it, so a low-priority
    request is preempted for the arrival): the first token comes from the first step."""
    sched = _loaded("priority", max_num_seqs=max_num_seqs, num_decodes=max_num_seqs - 2)
    assert len(sched.running) == max_num_seqs - 1
    sched.add(make_request("urgent", 12, 0, 20.0))
    assert _steps_to_first_token(sched, "urgent") == 1
    # Low-priority arrivals meanwhile do not delay later high-priority ones either.
    for i in range(3):
        sched.add(make_request(f"late{i}", 12, 9, 30.0 + i))
        sched.add(make_request(f"urgent{i}", 8, 0, 30.5 + i))  # fits beside the decodes
        assert _steps_to_first_token(sched, f"urgent{i}") == 1


def test_a_victim_swapped_out_for_priority_waits_behind_the_request_that_preempted_it():
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, scheduling_policy="priority",
                          reserve_new_tokens=False, preemption_mode="swap")
    sched = Scheduler(cfg, BlockManager(6, 4, num_host_blocks=16))
    for rid, arrival in [("x", 1.0), ("y", 2.0), ("z", 3.0)]:
        sched.add(make_request(rid, 8, 7, arrival))
    run_step(sched)
    assert sched.num_free_blocks == 0
    sched.add(make_request("urgent", 8, 0, 4.0))
    out = run_step(sched)
    assert [r.request_id for r in out.preempted] == ["z", "y"]
    assert "urgent" in admitted(out)
    assert out.blocks_to_swap_in == []
    assert [r.request_id for r in sched.swapped] == ["y", "z"]
