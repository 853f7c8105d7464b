"""rooflm simulate on a GPU: --calibrate fits the engine's real steps, and the simulator then
predicts an offline run of the same engine (a small model, so the test takes seconds)."""

import time

import pytest

from rooflm.config import SchedulerConfig
from rooflm.sampling_params import SamplingParams
from rooflm.sim.calibrate import calibrate
from rooflm.sim.cost_model import RooflineCostModel
from rooflm.sim.replica import ReplicaConfig
from rooflm.sim.simulator import SimConfig, simulate
from rooflm.sim.workload import LengthDist, synthetic_workload

pytestmark = pytest.mark.gpu


def test_calibrated_simulation_predicts_an_offline_run(tmp_path):
    from rooflm.engine.llm_engine import LLMEngine

    kwargs = dict(model="qwen3-0.6b", load_format="dummy", max_model_len=2048, max_num_seqs=128)
    grid = ((128, (1, 8, 32, 128)), (1024, (1, 8, 32)))
    table = calibrate(kwargs, grid=grid, output_tokens=16)
    assert table.fit["median_rel_error"] < 0.15, table.fit
    table.save(str(tmp_path / "cal.json"))

    requests = synthetic_workload(200, LengthDist("uniform", 300, 0.8), LengthDist("uniform", 100, 0.8), "offline")
    engine = LLMEngine.from_kwargs(**kwargs)
    for i, r in enumerate(requests):
        engine.add_request(f"r{i}", [100 + (7 * i + j) % 5000 for j in range(r.prompt_len)],
                           SamplingParams(max_tokens=r.output_len, ignore_eos=True, output_kind="final"))
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    measured = time.perf_counter() - t0

    info = engine.info
    sched = SchedulerConfig(max_num_seqs=info.max_num_seqs, max_num_batched_tokens=info.max_num_batched_tokens,
                            max_model_len=info.max_model_len)
    cfg = SimConfig(ReplicaConfig(sched, info.num_blocks, info.block_size, max_model_len=info.max_model_len,
                                  async_scheduling=info.async_scheduling), ingress_s=0.0,
                    vocab_size=info.model_config.vocab_size)
    from rooflm.perf.gpus import get_gpu
    cost = RooflineCostModel(info.model_config, get_gpu(table.gpu), correction=table.correction,
                             async_scheduling=info.async_scheduling)
    result = simulate(cfg, cost, requests)
    assert result.num_steps == engine.num_steps
    assert result.duration_s == pytest.approx(measured, rel=0.25)
