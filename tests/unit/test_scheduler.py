"""Scheduler on its own: budgets, chunked prefill, FCFS, preemption. No model, no device."""

from rooflm.config import SchedulerConfig
from rooflm.engine.block_manager import BlockManager
from rooflm.engine.request import Request, RequestStatus, Sequence
from rooflm.engine.scheduler import Scheduler
from rooflm.sampling_params import SamplingParams

_seq_ids = iter(range(10**6))


def make_request(rid, prompt_len, n=1, max_tokens=8):
    ids = list(range(1000 * (hash(rid) % 50), 1000 * (hash(rid) % 50) + prompt_len))
    req = Request(rid, None, ids, SamplingParams(n=n, max_tokens=max_tokens, temperature=0), max_tokens)
    req.seqs.append(Sequence(next(_seq_ids), 0, list(ids), prompt_len))
    return req


def run_step(sched, fake_token=7):
    """Schedule a step, then do what the engine does with its results: append the sampled token."""
    out = sched.schedule()  # advances num_computed_tokens; sampling sequences get a pending token
    for s in out.scheduled:
        if s.completes:
            s.seq.append_token(fake_token)
    return out


def test_token_budget_and_chunked_prefill():
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10), bm)
    sched.add(make_request("a", 23))
    out = run_step(sched)
    assert [s.num_new_tokens for s in out.scheduled] == [10]
    out = run_step(sched)
    assert [s.num_new_tokens for s in out.scheduled] == [10]
    out = run_step(sched)
    assert [s.num_new_tokens for s in out.scheduled] == [3]  # prompt done: samples its first token
    out = run_step(sched)
    assert [s.num_new_tokens for s in out.scheduled] == [1]  # decode


def test_decodes_and_prefill_chunks_mix_under_budget():
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8), bm)
    sched.add(make_request("a", 3))
    sched.add(make_request("b", 3))
    run_step(sched)  # both prefill (3 + 3 <= 8)
    sched.add(make_request("c", 20))
    out = run_step(sched)
    # Two decodes first, then a 6-token chunk of c fills the budget.
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("a", 1), ("b", 1), ("c", 6)]
    assert out.num_batched_tokens == 8


def test_sequence_cap_and_fcfs():
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100), bm)
    for rid in "abc":
        sched.add(make_request(rid, 4))
    out = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_no_chunking_when_disabled():
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10,
                                      enable_chunked_prefill=False), bm)
    sched.add(make_request("a", 12))
    assert run_step(sched).is_empty


def test_preempts_most_recent_and_recomputes():
    bm = BlockManager(4, 4)  # 16 token slots
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), bm)
    a, b = make_request("a", 8), make_request("b", 8)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # a: 2 blocks, b: 2 blocks, pool empty; both have 9 tokens now
    out = run_step(sched)  # both decode into full blocks: need 1 more block each
    assert out.preempted == [b]
    assert [s.request.request_id for s in out.scheduled] == ["a"]
    assert b.status == RequestStatus.WAITING and b.seqs[0].num_computed_tokens == 0
    assert b.seqs[0].block_table == [] and sched.waiting[0] is b
    assert sched.num_preemptions == 1


def test_swap_preemption_keeps_progress():
    bm = BlockManager(4, 4, num_host_blocks=8)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                      preemption_mode="swap"), bm)
    a, b = make_request("a", 8), make_request("b", 8)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    out = run_step(sched)
    assert out.preempted == [b] and b.status == RequestStatus.SWAPPED
    assert len(out.blocks_to_swap_out) == 2 and b.seqs[0].num_computed_tokens == 8
    sched.finish(a)  # a's blocks come back
    out = run_step(sched)
    assert b.status == RequestStatus.RUNNING and len(out.blocks_to_swap_in) == 2
    assert [s.num_new_tokens for s in out.scheduled] == [1]


def test_finish_frees_everything():
    bm = BlockManager(16, 4)
    sched = Scheduler(SchedulerConfig(), bm)
    r = make_request("a", 10)
    sched.add(r)
    run_step(sched)
    sched.finish(r)
    assert bm.num_free_blocks == 16 and not sched.has_unfinished()
