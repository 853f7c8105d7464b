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
    """Schedule a step, then do what the engine's output processor does with its results:
    register full blocks in the prefix cache, append the sampled token."""
    out = sched.schedule()  # advances num_computed_tokens; sampling sequences get a pending token
    for s in out.scheduled:
        sched.cache_computed_blocks(s.request, s.seq)
        if s.completes:
            s.seq.append_token(fake_token)
    return out


def fork(sched, req):
    """What the output processor does at a request's first sample with n > 1."""
    parent = req.seqs[0]
    for i in range(1, req.params.n):
        child = Sequence(next(_seq_ids), i, list(parent.token_ids), parent.num_prompt_tokens)
        child.output_token_ids = list(parent.output_token_ids)
        sched.fork_seq(parent, child)
        req.seqs.append(child)
    req.forked = True


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
    sched = Scheduler(SchedulerConfig(reserve_new_tokens=False, max_num_seqs=8, max_num_batched_tokens=64), bm)
    a, b = make_request("a", 8), make_request("b", 8)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # a: 2 blocks, b: 2 blocks, pool empty; both have 9 tokens now
    out = run_step(sched)  # both decode into full blocks: need 1 more block each
    assert out.preempted == [b]
    assert [s.request.request_id for s in out.scheduled] == ["a"]
    assert b.status == RequestStatus.WAITING and b.seqs[0].num_computed_tokens == 0
    assert b.seqs[0].block_table.ids == [] and sched.waiting[0] is b
    assert sched.num_preemptions == 1


def test_swap_preemption_keeps_progress():
    bm = BlockManager(4, 4, num_host_blocks=8)
    sched = Scheduler(SchedulerConfig(reserve_new_tokens=False, max_num_seqs=8, max_num_batched_tokens=64,
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
    sched = Scheduler(SchedulerConfig(max_num_seqs=8), bm)
    r = make_request("a", 10)
    sched.add(r)
    run_step(sched)
    sched.finish(r)
    assert bm.num_free_blocks == 16 and not sched.has_unfinished()


def test_prefix_hit_is_counted_in_tokens():
    bm = BlockManager(16, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), bm)
    first = make_request("a", 10)
    sched.add(first)
    run_step(sched)  # 2 full blocks registered
    again = make_request("a", 10)  # the same prompt
    sched.add(again)
    out = run_step(sched)
    assert [(s.request is again, s.start, s.num_new_tokens) for s in out.scheduled] == [
        (False, 10, 1), (True, 8, 2)]
    assert again.num_cached_tokens == 8 and again.seqs[0].block_table.ids[:2] == [0, 1]
    assert again.seqs[0].block_table.num_cached_blocks == 2
    assert (bm.prefix_queries, bm.prefix_hits) == (20, 8)


def test_swapped_request_comes_back_when_exactly_its_blocks_are_free():
    # No hedge: a swapped-out request whose next token fits its last block needs only
    # its own blocks back.
    bm = BlockManager(5, 4, num_host_blocks=8)
    sched = Scheduler(SchedulerConfig(reserve_new_tokens=False, max_num_seqs=8, max_num_batched_tokens=64,
                                      preemption_mode="swap"), bm)
    a, b, c = make_request("a", 8), make_request("b", 4), make_request("c", 6)
    for r in (a, b, c):
        sched.add(r)
    run_step(sched)  # 2 + 1 + 2 blocks: the pool is full
    out = run_step(sched)  # a and b each need a block: c (the newest) is swapped out
    assert out.preempted == [c] and c.status == RequestStatus.SWAPPED and bm.num_free_blocks == 0
    run_step(sched)
    assert c.status == RequestStatus.SWAPPED
    sched.finish(b)
    assert bm.num_free_blocks == 2  # c's 2 blocks, and its 7th token fits the second
    out = run_step(sched)
    assert c.status == RequestStatus.RUNNING and len(out.blocks_to_swap_in) == 2
    assert [(s.request.request_id, s.start) for s in out.scheduled] == [("a", 10), ("c", 6)]


def test_swapped_fork_copies_its_shared_partial_block_after_swap_in():
    bm = BlockManager(4, 4, num_host_blocks=8)
    sched = Scheduler(SchedulerConfig(reserve_new_tokens=False, max_num_seqs=8, max_num_batched_tokens=64,
                                      preemption_mode="swap"), bm)
    x, r = make_request("x", 8), make_request("r", 6, n=2)
    sched.add(x)
    sched.add(r)
    out = sched.schedule()
    for s in out.scheduled:
        if s.request is r:
            fork(sched, r)  # the two samples share blocks 2 and 3; 3 is half full
        for seq in s.request.seqs:
            seq.append_token(7)
    assert [s.block_table.ids for s in r.seqs] == [[2, 3], [2, 3]]
    out = run_step(sched)  # x needs a block: r is swapped out, its shared blocks moved once
    assert out.preempted == [r] and len(out.blocks_to_swap_out) == 2
    sched.finish(x)
    out = run_step(sched)
    assert r.status == RequestStatus.RUNNING and len(out.blocks_to_swap_in) == 2
    # The first writer copies the shared half-full block; the second then writes in place.
    assert len(out.blocks_to_copy) == 1
    tables = [s.block_table.ids for s in r.seqs]
    assert tables[0][0] == tables[1][0] and tables[0][1] != tables[1][1]
    sched.finish(r)
    assert bm.num_free_blocks == 4 and len(bm.free_host_blocks) == 8


def test_a_sample_that_finishes_while_swapped_out_frees_only_its_own_share():
    bm = BlockManager(4, 4, num_host_blocks=8)
    sched = Scheduler(SchedulerConfig(reserve_new_tokens=False, max_num_seqs=8, max_num_batched_tokens=64,
                                      preemption_mode="swap"), bm)
    x, r = make_request("x", 8), make_request("r", 6, n=2)
    sched.add(x)
    sched.add(r)
    out = sched.schedule()
    fork(sched, r)
    for s in out.scheduled:
        for seq in s.request.seqs:
            seq.append_token(7)
    run_step(sched)  # r swapped out
    assert r.status == RequestStatus.SWAPPED
    r.seqs[1].finish_reason = "stop"
    sched.free_seq(r.seqs[1])
    assert len(bm.free_host_blocks) == 6  # the survivor still holds both host blocks
    sched.finish(x)
    out = run_step(sched)
    assert r.status == RequestStatus.RUNNING and out.blocks_to_copy == []
    sched.finish(r)
    assert bm.num_free_blocks == 4 and len(bm.free_host_blocks) == 8


def test_swap_outs_of_a_step_that_runs_nothing_go_with_the_next_step():
    # The engine launches no empty step, so its block ops would be lost: the K/V swapped
    # back in later would be whatever the host blocks held.
    bm = BlockManager(2, 4, num_host_blocks=8)
    sched = Scheduler(SchedulerConfig(reserve_new_tokens=False, max_num_seqs=8, max_num_batched_tokens=64,
                                      preemption_mode="swap"), bm)
    a = make_request("a", 8)
    sched.add(a)
    run_step(sched)  # the pool is full
    out = run_step(sched)  # a needs a third block: it preempts itself, and nothing runs
    assert out.preempted == [a] and out.is_empty and out.blocks_to_swap_out == []
    sched.add(make_request("c", 3))
    out = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["c"]
    assert out.blocks_to_swap_out == [(0, 0), (1, 1)]
    assert run_step(sched).blocks_to_swap_out == []  # sent once


def _run_two_growing_requests(reserve: bool) -> tuple[Scheduler, list[str]]:
    """8 blocks of 4 = 32 slots; two requests of 8 prompt tokens and 16 new tokens each (24
    tokens, 6 blocks apiece at the end): both fit at admission, not both at the end."""
    bm = BlockManager(8, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                      reserve_new_tokens=reserve), bm)
    a, b = make_request("a", 8, max_tokens=16), make_request("b", 8, max_tokens=16)
    sched.add(a)
    sched.add(b)
    first = [s.request.request_id for s in run_step(sched).scheduled]
    for _ in range(100):
        if not sched.has_unfinished():
            break
        run_step(sched)
        for req in list(sched.running):
            if req.seqs[0].num_output_tokens >= req.max_tokens:
                req.seqs[0].finish_reason = "length"
                sched.finish(req)
    assert not sched.has_unfinished()
    return sched, first


def test_admission_keeps_room_for_the_running_requests_growth():
    # With the reservation b waits until a's expected growth leaves it room: no preemption.
    sched, first = _run_two_growing_requests(reserve=True)
    assert first == ["a"] and sched.num_preemptions == 0
    # Without it both start at once and one of them is preempted when the two outgrow the pool.
    sched, first = _run_two_growing_requests(reserve=False)
    assert first == ["a", "b"] and sched.num_preemptions >= 1


def test_reservation_never_keeps_an_idle_engine_waiting():
    # The expected growth of a lone request exceeds the pool: it runs anyway.
    bm = BlockManager(4, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), bm)
    a = make_request("a", 8, max_tokens=1000)
    sched.add(a)
    out = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["a"]


def test_new_token_ratio_decays_and_rises_after_a_preemption():
    from rooflm.engine.growth_reserve import INIT_RATIO, MIN_RATIO, NewTokenRatio

    ratio = NewTokenRatio()
    for _ in range(10_000):
        ratio.decay()
    assert ratio.value == INIT_RATIO  # nothing has finished yet: no evidence to go lower
    ratio.observe_finished(num_output_tokens=10, max_tokens=1000)  # outputs end early
    for _ in range(10_000):
        ratio.decay()
    assert ratio.value == MIN_RATIO
    ratio.raise_after_preemption(generated=300, max_new=400, num_seqs=2)
    assert ratio.value == (300 + 20 * 2) / 400 > INIT_RATIO
    ratio.raise_after_preemption(generated=4000, max_new=400, num_seqs=2)
    assert ratio.value == 1.0


def test_new_token_ratio_stays_up_when_requests_use_all_of_max_tokens():
    from rooflm.engine.growth_reserve import NewTokenRatio

    ratio = NewTokenRatio()
    for _ in range(5):
        ratio.observe_finished(num_output_tokens=1024, max_tokens=1024)
    for _ in range(10_000):
        ratio.decay()
    assert ratio.value == 1.0


def test_finished_requests_teach_the_ratio_their_share_of_max_tokens():
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), bm)
    req = make_request("a", 8, max_tokens=40)
    sched.add(req)
    for _ in range(10):
        run_step(sched)
    req.seqs[0].finish_reason = "stop"
    sched.finish(req)
    assert sched.new_token_ratio.used_share == req.seqs[0].num_output_tokens / 40


def test_unresolved_sequence_cap_is_refused():
    import pytest

    with pytest.raises(ValueError, match="max_num_seqs"):
        Scheduler(SchedulerConfig(), BlockManager(4, 4))


def test_default_sequence_cap_follows_the_device():
    from rooflm.config import EngineConfig, default_max_num_seqs, with_device_defaults

    assert default_max_num_seqs("cpu") == 256
    assert default_max_num_seqs("cuda", 24.0) == 512
    assert default_max_num_seqs("cuda", None) == 512
    assert default_max_num_seqs("cuda", 85.0) == 1024  # an 80 GB H100
    cfg = with_device_defaults(EngineConfig(), "cuda", device_memory_gb=150.0)
    assert cfg.scheduler.max_num_seqs == 1024 and cfg.runtime.cuda_graph_max_batch == 1024
    # A cap the user set stays.
    cfg = with_device_defaults(EngineConfig(scheduler=SchedulerConfig(max_num_seqs=64)), "cuda", device_memory_gb=150.0)
    assert cfg.scheduler.max_num_seqs == 64 and cfg.runtime.cuda_graph_max_batch == 64
