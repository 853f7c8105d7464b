"""Pipeline parallelism on the CPU (gloo): PP=2 gives the tokens PP=1 gives on tiny random
models of every family, PP=2 x TP=2 too; the layer split; sizes and features that do not
compose fail at start, naming the flag; a stage that dies fails the engine.

Each family runs one PP=1 engine (in this process) and one PP=2 engine (rank 1 spawned). The
tiny checkpoints are the parity tests' (tests/models/), each family's options turned on, so the
stage boundary falls between layers of different kinds where a family has them (Gemma 3's
sliding and global layers, Qwen2-MoE's dense and sparse ones). fp32, exact tokens and logprobs
to 1e-4. The llama case adds what crosses stages besides the layers: async scheduling (pending
ids, filled on stage 0 only), prompt logprobs (their rows come back from the last stage), n > 1
(copy-on-write in every stage's pool), and swap preemption of an FP8 cache with static scales
(each stage's layers' scales).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from rooflm import LLM
from rooflm.distributed.pipeline import even_partition, layer_partition, scored_rows
from rooflm.engine.executor import WorkerDied
from rooflm.engine.llm_engine import LLMEngine
from rooflm.sampling_params import SamplingParams
from tests.models.test_families_parity import make_tiny
from tests.models.test_moe_parity import make_tiny_moe
from tests.models.tiny_models import make_tiny_model

PROMPTS = [[5, 9, 33, 7, 81, 12], [100, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [17]]
FRESH = list(range(40, 53))  # no prefix of it cached: every prompt position gets its logprobs
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)


def _tiny_family(root, family: str):
    """The checkpoint of a tiny model of `family` (every registry family has one)."""
    if family in ("llama", "mistral", "qwen2", "qwen3", "olmo2", "gemma2"):
        options = {"llama": dict(num_hidden_layers=3), "qwen2": dict(tied=True, attention="mqa", vocab_size=250),
                   "gemma2": dict(num_hidden_layers=3)}.get(family, {})
        return str(make_tiny_model(root, family, **options)[0])
    if family in ("gemma3", "phi3", "granite", "smollm3"):
        return make_tiny(root, family)[0]
    if family == "gpt_oss":
        from tests.models.test_gpt_oss import make_tiny_gpt_oss
        return make_tiny_gpt_oss(root)[0]
    return make_tiny_moe(root, family)[0]


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "olmo2", "gemma2", "gemma3", "phi3", "granite", "smollm3",
            "qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "gpt_oss"]


def _run(path: str, engine_options: dict, extra: bool = False):
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=4, **engine_options)
    try:
        outs = llm.generate(PROMPTS, GREEDY)
        more = None
        if extra:
            more = llm.generate([FRESH], SamplingParams(max_tokens=6, n=2, temperature=1.0, seed=7,
                                                             ignore_eos=True, prompt_logprobs=1))[0]
        return outs, more, llm.engine.snapshot()
    finally:
        llm.shutdown()


def _assert_same(one, two) -> None:
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
    for a, b in zip(one, two):
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert lp_a.keys() == lp_b.keys()
            for token in lp_a:
                assert lp_b[token].logprob == pytest.approx(lp_a[token].logprob, abs=1e-4)


def test_the_registry_has_no_family_this_test_misses():
    from rooflm.model.registry import FAMILIES as REGISTERED
    assert len(REGISTERED) == len(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_pp2_gives_the_tokens_of_pp1(tmp_path, family):
    path = _tiny_family(tmp_path, family)
    one, _, _ = _run(path, {})
    two, _, _ = _run(path, {"pipeline_parallel_size": 2})
    _assert_same(one, two)


def test_pp2_features_cross_the_stages(tmp_path):
    """Async scheduling, prompt logprobs, n > 1 and swap preemption of a static-scale FP8 cache."""
    path = str(make_tiny_model(tmp_path, "llama", num_hidden_layers=3)[0])
    options = {"async_scheduling": True, "preemption_mode": "swap", "num_blocks": 8, "swap_space_gb": 0.01,
               "reserve_new_tokens": False, "kv_cache_dtype": "fp8", "kv_cache_scales": "static"}
    one, one_extra, _ = _run(path, options, extra=True)
    two, two_extra, snapshot = _run(path, {**options, "pipeline_parallel_size": 2}, extra=True)
    _assert_same(one, two)
    assert [s.token_ids for s in two_extra.outputs] == [s.token_ids for s in one_extra.outputs]
    assert len(two_extra.prompt_logprobs) == len(one_extra.prompt_logprobs) == len(FRESH)
    for a, b in zip(one_extra.prompt_logprobs[1:], two_extra.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        for token in a:
            assert b[token].logprob == pytest.approx(a[token].logprob, abs=1e-4)
    assert snapshot.num_preemptions > 0  # the swap path ran on every stage's pool


def test_batches_in_flight_split_the_requests(tmp_path, monkeypatch):
    """Two batches in flight (the default at PP=2) hold different requests and alternate, each
    request's tokens those of one step at a time (--pipeline-micro-batches 1) and of PP=1; each
    batch keeps its sampling metadata while the other runs."""
    from rooflm.layers.sampler import SamplingMetadata

    builds = []
    build = SamplingMetadata.build
    monkeypatch.setattr(SamplingMetadata, "build", staticmethod(lambda *a, **k: builds.append(1) or build(*a, **k)))
    path = str(make_tiny_model(tmp_path, "llama", num_hidden_layers=3)[0])
    prompts = PROMPTS + [[8, 8, 9], [200, 201, 3, 3]]
    runs = {}
    for name, options in (("pp1", {}), ("one", {"pipeline_parallel_size": 2, "pipeline_micro_batches": 1}),
                          ("two", {"pipeline_parallel_size": 2})):
        llm = LLM(model=path, dtype="float32", device="cpu", block_size=4, **options)
        builds.clear()
        try:
            batches = []  # at each finished batch: the batches still in flight
            llm.engine._observers.append(lambda r: batches.append(len(llm.engine.pipeline)))
            outs = llm.generate(prompts, GREEDY)
            runs[name] = (outs, llm.engine.num_steps, batches, len(builds))
        finally:
            llm.shutdown()
    _assert_same(runs["pp1"][0], runs["one"][0])
    _assert_same(runs["pp1"][0], runs["two"][0])
    assert runs["one"][1] == runs["pp1"][1] == GREEDY.max_tokens  # every request in every step
    assert runs["two"][1] == 2 * GREEDY.max_tokens  # two batches, of 3 and 2 requests, alternate
    assert max(runs["two"][2]) == 1  # a batch finished while the other was in flight
    assert runs["two"][3] == runs["one"][3] + 1 == 2  # one build per batch: both kept


def test_pp2_x_tp2_gives_the_tokens_of_one_process(tmp_path):
    """Four processes: two stages of two TP ranks (each stage's TP group its own)."""
    path = str(make_tiny_model(tmp_path, "llama", attention="gqa", num_hidden_layers=3)[0])
    one, _, _ = _run(path, {})
    four, _, _ = _run(path, {"pipeline_parallel_size": 2, "tensor_parallel_size": 2})
    _assert_same(one, four)


def test_three_stages_and_a_partition_override(tmp_path, monkeypatch):
    """Three stages (a middle one that neither embeds nor scores), split 1 + 1 + 2 by the
    override; a stage-2 worker that dies fails the engine with WorkerDied, nothing left behind."""
    path = str(make_tiny_model(tmp_path, "llama", num_hidden_layers=4)[0])
    one, _, _ = _run(path, {})
    monkeypatch.setenv("ROOFLM_PP_LAYER_PARTITION", "1,1,2")  # read by rank 0 and the spawned ranks
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=4, pipeline_parallel_size=3)
    try:
        assert (llm.engine.runner.stage.start, llm.engine.runner.stage.end) == (0, 1)
        assert llm.engine.runner.kv_cache.shape[0] == 1  # stage 0's pool: its one layer
        _assert_same(one, llm.generate(PROMPTS, GREEDY))
        _kill_a_worker_mid_request(llm.engine, llm.engine.executor.processes[1])
    finally:
        llm.shutdown()


def _kill_a_worker_mid_request(engine: LLMEngine, worker) -> None:
    engine.add_request("long", PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    os.kill(worker.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    with pytest.raises((WorkerDied, RuntimeError)):
        while time.monotonic() < deadline:
            engine.step()
    assert time.monotonic() < deadline
    with pytest.raises(WorkerDied, match="exited with code -9"):
        engine.check_alive()
    assert not any(p.is_alive() for p in engine.executor.processes)


def test_layer_partition():
    assert even_partition(32, 2) == [16, 16]
    assert even_partition(30, 4) == [7, 7, 8, 8]  # the remainder to the last stages: stage 0 scores
    assert layer_partition(5, 2) == [(0, 2), (2, 5)]
    assert layer_partition(5, 2, (4, 1)) == [(0, 4), (4, 5)]
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 exceeds the model's 2 layers"):
        layer_partition(2, 3)
    with pytest.raises(ValueError, match="names 3 stages but pipeline_parallel_size is 2"):
        layer_partition(6, 2, (2, 2, 2))
    with pytest.raises(ValueError, match="sum to the model's 6 layers"):
        layer_partition(6, 2, (2, 2))
    with pytest.raises(ValueError, match="at least one layer"):
        layer_partition(6, 2, (6, 0))
    assert scored_rows([9, 3], [(4, 3), (2, 2)]) == [2, 3, 4, 5, 6, 9]


def test_what_does_not_compose_fails_at_start_naming_the_flag(tmp_path):
    path = str(make_tiny_model(tmp_path, "llama")[0])  # 2 layers
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 exceeds the model's 2 layers"):
        LLM(model=path, dtype="float32", device="cpu", pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="--speculative-method does not run with --pipeline-parallel-size"):
        LLM(model=path, dtype="float32", device="cpu", pipeline_parallel_size=2, speculative_method="ngram",
            num_speculative_tokens=2)
    with pytest.raises(ValueError, match="--enable-lora does not run with --pipeline-parallel-size"):
        LLM(model=path, dtype="float32", device="cpu", pipeline_parallel_size=2, enable_lora=True)


def test_the_flag_and_its_short_form():
    import argparse

    from rooflm.config import engine_config_from_kwargs
    from rooflm.engine_args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)

    def size(argv: list[str]) -> int:
        return engine_config_from_kwargs(**engine_kwargs(parser.parse_args(argv))).parallel.pipeline_parallel_size

    assert size(["-pp", "2"]) == 2
    assert size(["--pipeline-parallel-size", "4"]) == 4
    with pytest.raises(ValueError, match="pipeline_parallel_size must be >= 1"):
        size(["-pp", "0"])


def test_memory_plans_each_stage(capsys):
    from rooflm.cli import main
    from rooflm.model.presets import PRESETS
    from rooflm.perf.memory import inference_memory, stage_weight_bytes, weight_bytes

    cfg = PRESETS["llama-3-8b"]
    parts = [stage_weight_bytes(cfg, "bf16", 2, 16, True, False), stage_weight_bytes(cfg, "bf16", 2, 16, False, True)]
    assert sum(parts) == pytest.approx(weight_bytes(cfg, "bf16", 2), rel=1e-9)  # every weight once
    assert parts[0] - parts[1] == pytest.approx(2 * cfg.vocab_size * cfg.hidden_size * 2 / 2, rel=1e-3)
    one = inference_memory(cfg, gpu_mem_gb=141, context=8192)
    two = inference_memory(cfg, gpu_mem_gb=141, context=8192, pp=2)
    assert [s.layers for s in two.stages] == [(0, 16), (16, 32)]
    assert two.stages[0].num_blocks < two.stages[1].num_blocks  # stage 0 also holds the embedding and head
    assert two.num_blocks == two.stages[0].num_blocks
    assert two.block_bytes == pytest.approx(one.block_bytes / 2)  # a block holds half the layers
    assert 2 * one.num_blocks < two.num_blocks < 2.2 * one.num_blocks
    assert main(["memory", "--model", "llama-3-8b", "-pp", "2", "--gpu", "h200"]) == 0
    out = capsys.readouterr().out
    assert "pipeline stage 0: layers 0-15 + embedding + LM head" in out
    assert "pipeline stage 1: layers 16-31 + final norm" in out
    assert "2 x 16 layers" in out


def test_simulator_prices_the_stages_in_turn():
    from rooflm.engine.report import BatchShape
    from rooflm.model.presets import PRESETS
    from rooflm.perf.gpus import get_gpu
    from rooflm.sim.cost_model import RooflineCostModel

    cfg = PRESETS["llama-3-8b"]
    one, two = (RooflineCostModel(cfg, get_gpu("h200"), pp=pp) for pp in (1, 2))
    shape = BatchShape(num_decode_seqs=64, decode_context_tokens=64 * 1000)
    p2p = two.pipeline_seconds(shape)
    link = get_gpu("h200").interconnect_gbs * 1e9 * two.link_efficiency
    assert p2p == pytest.approx((2 * 64 * 4096 * 2 + 64 * 4096 * 2) / link + 2 * two.allreduce_latency_s)
    assert two.device_seconds(shape) == pytest.approx(one.device_seconds(shape) + p2p)
    assert (one.bubble, two.bubble) == (0.0, 0.5)
    assert "PP 2" in two.describe() and "idle 50%" in two.describe()


def test_simulated_replica_keeps_batches_in_flight():
    """The simulated engine runs the engine's scheduler with batches in flight: each batch takes
    half the sequences, the stages overlap, and the same work ends sooner than one step at a
    time (priced by one step-cost model: a fixed cost per step plus one per sequence)."""
    from dataclasses import replace

    from rooflm.config import SchedulerConfig
    from rooflm.sim.cost_model import SyntheticCostModel
    from rooflm.sim.replica import ReplicaConfig
    from rooflm.sim.simulator import SimConfig, simulate
    from rooflm.sim.workload import LengthDist, synthetic_workload

    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)
    base = ReplicaConfig(sched, num_blocks=1000, block_size=4, max_model_len=128, pipeline_stages=2)
    reqs = synthetic_workload(16, LengthDist("fixed", 8), LengthDist("fixed", 12), "offline", 1.0, seed=0)
    cost = SyntheticCostModel(step_s=0.004, per_seq_s=1e-3)
    one = simulate(SimConfig(base, ingress_s=0.0), cost, reqs)
    two = simulate(SimConfig(replace(base, micro_batches=2), ingress_s=0.0), cost, reqs)
    assert all(r.finish_s is not None and len(r.token_times) == 12 for r in one.records + two.records)
    assert two.duration_s < 0.8 * one.duration_s
    assert two.num_steps == 2 * one.num_steps  # two batches of 4 for every step of 8


def test_config_checks_the_pipeline_fields():
    from rooflm.config import ParallelConfig
    assert ParallelConfig().batches_in_flight == 1
    assert ParallelConfig(pipeline_parallel_size=3).batches_in_flight == 3
    assert ParallelConfig(pipeline_parallel_size=3, pipeline_micro_batches=1).batches_in_flight == 1
    with pytest.raises(ValueError, match="pipeline_micro_batches must be >= 1"):
        ParallelConfig(pipeline_parallel_size=2, pipeline_micro_batches=0)
    with pytest.raises(ValueError, match="tp_allreduce must be one of"):
        ParallelConfig(pipeline_parallel_size=2, tp_allreduce="fast")


def test_scheduler_splits_the_requests_between_batches_in_flight():
    """Device-free: with two batches in flight each step takes half the sequences, and a sequence
    whose token is on its way (pending) waits for it instead of joining the next batch."""
    from rooflm.config import SchedulerConfig
    from rooflm.engine.block_manager import BlockManager
    from rooflm.engine.scheduler import Scheduler
    from tests.unit.test_scheduler import make_request

    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), BlockManager(64, 4))
    sched.use_micro_batches(2)
    reqs = {rid: make_request(rid, 3) for rid in "abcde"}
    for req in reqs.values():
        sched.add(req)

    def ids(out):
        return [s.request.request_id for s in out.scheduled]

    a = sched.schedule()
    assert ids(a) == ["a", "b", "c"]  # ceil(5 / 2)
    b = sched.schedule()
    assert ids(b) == ["d", "e"]  # a, b, c wait for their tokens
    assert sched.schedule().is_empty  # every sequence has a token in flight
    for s in a.scheduled:  # batch A's tokens reach the host
        s.seq.append_token(7)
    assert ids(sched.schedule()) == ["a", "b", "c"]  # decodes, while d and e are still in flight
    assert sched.schedule().is_empty  # all five in flight again


@pytest.mark.slow
def test_the_default_model_gguf_splits_into_stages():
    """SmolLM2-135M as its Q4_1 GGUF (the default model): each stage keeps its layers' quantized
    blocks, stage 0 the tied head's; PP=2 greedy text equals PP=1's."""
    prompts = ["The capital of France is", "def fib(n):"]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    texts = []
    for pp in (1, 2):
        llm = LLM(max_model_len=256, num_blocks=64, block_size=16, pipeline_parallel_size=pp)
        try:
            texts.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        finally:
            llm.shutdown()
    assert texts[0] == texts[1]


def test_a_pp_server_serves_concurrent_requests(tmp_path):
    """`rooflm serve -pp 2`: the engine core process runs stage 0 and spawns stage 1; concurrent
    requests get PP=1's greedy tokens."""
    import concurrent.futures

    import httpx

    from tests.server.server_utils import start_server

    path = str(make_tiny_model(tmp_path, "llama", num_hidden_layers=3)[0])
    one, _, _ = _run(path, {})
    server = start_server(tmp_path, "pp2", [
        "--model", path, "--pipeline-parallel-size", "2", "--device", "cpu", "--dtype", "float32",
        "--max-model-len", "256", "--num-blocks", "64", "--block-size", "4", "--log-interval", "0"])
    try:
        server.wait_ready()

        def complete(prompt):
            body = {"model": "llama-gqa-untied-seed0", "prompt": prompt, "max_tokens": GREEDY.max_tokens,
                    "temperature": 0, "ignore_eos": True, "logprobs": 1}
            response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["logprobs"]["token_logprobs"]

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            served = list(pool.map(complete, PROMPTS))
    finally:
        server.stop()
    # The served tokens' logprobs are those of PP=1's greedy tokens (this model has no tokenizer
    # to name them): the same tokens at every position.
    for logprobs, out in zip(served, one):
        sample = out.outputs[0]
        expected = [entry[t].logprob for entry, t in zip(sample.logprobs, sample.token_ids)]
        assert logprobs == pytest.approx(expected, abs=1e-4)
