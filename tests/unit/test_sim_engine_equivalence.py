"""The simulator runs the engine's own scheduler: with the same requests added at the same step
calls, a SimReplica must schedule exactly what LLMEngine schedules, step by step (batch shapes,
admissions, preemptions), in sync and async mode, with recompute and swap preemption. The real
engine runs a tiny random model on the CPU."""

import math

import pytest

from rooflm.config import SchedulerConfig
from rooflm.engine.llm_engine import LLMEngine
from rooflm.sampling_params import SamplingParams
from rooflm.sim.cost_model import SyntheticCostModel
from rooflm.sim.metrics import sim_metrics
from rooflm.sim.replica import ReplicaConfig, RequestRecord, SimReplica
from rooflm.sim.simulator import SimConfig, simulate
from rooflm.sim.workload import SimRequest
from tests.models.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path, _ = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    return path


# (step call before which the request is added, prompt length, max_tokens)
WORKLOAD = [(0, 37, 12), (0, 21, 20), (0, 50, 8), (0, 9, 15), (0, 44, 18), (3, 30, 10), (3, 17, 25),
            (5, 26, 6), (9, 60, 14), (9, 12, 9), (14, 33, 16), (20, 5, 30)]


def prompt(i: int, n: int) -> list[int]:
    return [(7 * i + 3 * j + 11) % 250 + 1 for j in range(n)]


def run_engine(path, **kw):
    engine = LLMEngine.from_kwargs(model=path, device="cpu", dtype="float32", **kw)
    shapes, admitted = [], []
    engine.add_observer(lambda report: shapes.append((report.shape, report.num_seqs, report.num_preempted)))
    calls = 0
    pending = list(enumerate(WORKLOAD))
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][0] <= calls:
            i, (_, n, max_tokens) = pending.pop(0)
            engine.add_request(f"r{i}", prompt(i, n), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        engine.step()
        calls += 1
        for req in engine.scheduler.running:  # tests may read the engine's insides
            if req.request_id not in admitted:
                admitted.append(req.request_id)
    info = engine.info
    return shapes, admitted, engine.snapshot().num_preemptions, info


def run_replica(info, async_scheduling: bool, preemption_mode: str, reserve: bool):
    sched = SchedulerConfig(max_num_seqs=info.max_num_seqs, max_num_batched_tokens=info.max_num_batched_tokens,
                            max_model_len=info.max_model_len, preemption_mode=preemption_mode,
                            reserve_new_tokens=reserve)
    cfg = ReplicaConfig(sched, info.num_blocks, info.block_size, True, info.num_host_blocks,
                        info.max_model_len, async_scheduling)
    replica = SimReplica(cfg, SyntheticCostModel(step_s=1.0))
    admitted = []
    calls, now = 0, 0.0
    pending = list(enumerate(WORKLOAD))
    while pending or replica.has_work():
        while pending and pending[0][1][0] <= calls:
            i, (_, n, max_tokens) = pending.pop(0)
            record = RequestRecord(f"r{i}", now, n, max_tokens)
            assert replica.add_request(record, prompt(i, n), max_tokens, stops_early=False)
        following = replica.step_call(now)
        now = now if following is None else following
        calls += 1
        for req in replica.scheduler.running:
            if req.request_id not in admitted:
                admitted.append(req.request_id)
    shapes = [(s.shape, None, s.num_preempted) for s in replica.steps]
    return replica, shapes, admitted


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("preemption_mode,reserve", [("recompute", False), ("swap", False), ("recompute", True)])
def test_replica_schedules_exactly_what_the_engine_schedules(tiny_path, async_scheduling, preemption_mode, reserve):
    # A small pool and budget, so that the run chunks prefills, stalls admissions and preempts.
    shapes, admitted, preemptions, info = run_engine(
        tiny_path, block_size=4, num_blocks=40, max_num_batched_tokens=24, max_num_seqs=6,
        preemption_mode=preemption_mode, reserve_new_tokens=reserve, async_scheduling=async_scheduling,
        swap_space_gb=0.001)
    replica, sim_shapes, sim_admitted = run_replica(info, async_scheduling, preemption_mode, reserve)
    assert len(sim_shapes) == len(shapes) == replica.num_steps
    assert [s[0] for s in sim_shapes] == [s[0] for s in shapes]
    assert [s[2] for s in sim_shapes] == [s[2] for s in shapes]
    assert sim_admitted == admitted
    assert replica.num_preemptions == preemptions
    if not reserve:
        assert preemptions > 0, "the workload should preempt with this pool"
    assert len(replica.finished) == len(WORKLOAD)
    assert all(len(r.token_times) == WORKLOAD[int(r.request_id[1:])][2] for r in replica.finished)
    assert replica.block_manager.num_free_blocks == replica.block_manager.num_blocks


def test_simulate_offline_matches_the_engine_step_count(tiny_path):
    """The whole simulator (event loop, arrivals at t=0, no ingress delay) on an offline batch."""
    engine = LLMEngine.from_kwargs(model=tiny_path, device="cpu", dtype="float32", block_size=4,
                                   num_blocks=60, max_num_batched_tokens=32, max_num_seqs=8)
    lengths = [(5 + 7 * i % 40, 4 + 3 * i % 17) for i in range(20)]
    from rooflm.sim import simulator

    # The engine gets the prompts the simulator will draw: same rng, same order.
    import random
    rng = random.Random(1)
    vocab = range(100, 256)
    prompts = [rng.choices(vocab, k=p) for p, _ in lengths]
    for i, ((p, o), ids) in enumerate(zip(lengths, prompts)):
        engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=o, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    info = engine.info
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=info.max_model_len)
    cfg = SimConfig(ReplicaConfig(sched, 60, 4, True, info.num_host_blocks, info.max_model_len,
                                  async_scheduling=info.async_scheduling),
                    ingress_s=0.0, vocab_size=256, seed=0)
    requests = [SimRequest(0.0, p, o) for p, o in lengths]
    result = simulator.simulate(cfg, SyntheticCostModel(step_s=0.01), requests)
    assert result.num_steps == engine.num_steps
    assert result.num_preemptions == engine.snapshot().num_preemptions
    metrics = sim_metrics(result)
    assert metrics["completed"] == 20 and metrics["total_output_tokens"] == sum(o for _, o in lengths)
    # Every step took 10 ms: the run took exactly num_steps x 10 ms.
    assert math.isclose(result.duration_s, 0.01 * result.num_steps)


def test_early_stop_and_rejection():
    """A request that stops before max_tokens (EOS) finishes at its output length and frees its
    blocks; one that can never fit the pool is failed with the engine's message."""
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
    cfg = SimConfig(ReplicaConfig(sched, num_blocks=20, block_size=4, max_model_len=256), ingress_s=0.0)
    requests = [SimRequest(0.0, 10, 5, max_tokens=40), SimRequest(0.0, 100, 10)]
    result = simulate(cfg, SyntheticCostModel(step_s=0.01), requests)
    ok, rejected = result.records
    assert len(ok.token_times) == 5 and ok.finish_s is not None
    assert "KV-cache blocks" in rejected.error
    metrics = sim_metrics(result)
    assert metrics["completed"] == 1 and metrics["failed"] == 1
    assert result.replicas[0].block_manager.num_free_blocks == 20
