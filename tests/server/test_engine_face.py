"""The server over a tiny engine, in-process: what it reads of the engine is the engine's face.

The engine's refusals (InvalidRequest) reach the client with their param, and
the Prometheus step metrics are exactly what a StepMeter computes from the
engine's own StepReports. A 2-layer random model without a tokenizer: prompts
are token ids; the text is noise, the paths are the real ones.
"""

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from rooflm.engine.report import BatchShape, EngineSnapshot
from rooflm.perf.gpus import GPUS
from rooflm.perf.live import MeterSummary, StepMeter
from rooflm.server.app import create_app
from rooflm.server.config import ServerConfig
from rooflm.server.stats import stats_line, step_gpu, with_bandwidth
from tests.models.tiny_models import make_tiny_model

CONTEXT = 512  # the tiny model's max_position_embeddings
NUM_BLOCKS = 8  # of 16 tokens: a pool smaller than the context
PEAK_GBS = 100.0


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    path, _ = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", initializer_range=0.3)
    engine_kwargs = dict(model=path, device="cpu", dtype="float32", num_blocks=NUM_BLOCKS)
    config = ServerConfig(served_model_name="tiny", log_interval=0, warmup=False,
                          peak_bandwidth_gbs=PEAK_GBS)
    return create_app(engine_kwargs, config)


def _completion(client: TestClient, **fields):
    return client.post("/v1/completions", json={"model": "tiny", "prompt": list(range(1, 11)),
                                                "max_tokens": 4, **fields})


def _error(response) -> dict:
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_engine_refusals_keep_their_param(app):
    with TestClient(app) as client:
        # The engine's own check: 10 + 200 tokens need 14 KV blocks of a pool of 8.
        error = _error(_completion(client, max_tokens=200))
        assert error["param"] == "max_tokens" and "KV-cache blocks" in error["message"]
        # SamplingParams': min_tokens over the default max_tokens (16) the server filled in.
        error = _error(_completion(client, max_tokens=None, min_tokens=20))
        assert error["param"] == "min_tokens"
        # The context-length rule, shared with the engine: 600 prompt tokens do not fit 512.
        error = _error(_completion(client, prompt=[1] * 600))
        assert error["param"] == "prompt" and f"context length is {CONTEXT}" in error["message"]
        error = _error(_completion(client, max_tokens=CONTEXT))
        assert error["param"] == "max_tokens"
        assert client.get("/health").status_code == 200


def _gauge(text: str, name: str):
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    return None


def test_prometheus_mbu_is_the_step_meters(app):
    state = app.state.rooflm
    reports = []
    state.engine.add_observer(reports.append)
    try:
        with TestClient(app) as client:
            response = _completion(client, max_tokens=5, ignore_eos=True)
            assert response.status_code == 200, response.text
            metrics = client.get("/metrics").text
    finally:
        state.engine.remove_observer(reports.append)
    assert len(reports) >= 5  # the prefill, then a decode per token
    # A second meter, fed the same reports, against the same peaks.
    meter = StepMeter.for_engine(state.info, step_gpu(state.info, PEAK_GBS))
    stats = [meter.observe(report) for report in reports]
    assert stats[-1].mbu is not None and stats[-1].mbu > 0
    assert _gauge(metrics, "rooflm:mbu") == stats[-1].mbu
    assert _gauge(metrics, "rooflm:mfu") is None  # a CPU's peak FLOP/s is unknown
    assert _gauge(metrics, "rooflm:step_time_seconds_count") == len(reports)
    assert _gauge(metrics, "rooflm:step_time_seconds_sum") == pytest.approx(
        sum(s.elapsed_s for s in stats))


def test_peaks_for_mbu_and_mfu(app):
    info = app.state.rooflm.info
    assert step_gpu(info, 0.0) is None  # a CPU, no bandwidth given: no MBU, no MFU
    h100 = with_bandwidth(GPUS["h100"], 2500.0)
    assert h100.mem_bw == 2500e9 and h100.peak_tflops == GPUS["h100"].peak_tflops
    # A device the table lacks, with --peak-bandwidth-gbs: MBU, and no made-up MFU.
    bandwidth_only = StepMeter.for_engine(info, step_gpu(info, 50.0))
    stats = bandwidth_only.record(BatchShape(num_decode_seqs=4, decode_context_tokens=400), 1e-3)
    assert stats.mbu == pytest.approx(stats.bytes / 1e-3 / 50e9) and stats.mfu is None


def _snapshot(**fields) -> EngineSnapshot:
    zero = dict.fromkeys(EngineSnapshot.__dataclass_fields__, 0)
    return EngineSnapshot(**{**zero, "num_blocks": 8, **fields})


def test_log_line_reads_the_snapshot_and_the_meter():
    before = _snapshot(generation_tokens=100, prefix_queried_tokens=10)
    after = _snapshot(num_running_reqs=2, num_waiting_reqs=1, num_swapped_reqs=1, num_free_blocks=6,
                      generation_tokens=150, prefix_queried_tokens=30, prefix_hit_tokens=5)
    summary = MeterSummary(steps=3, busy_s=0.5, tokens_per_s=300.0, sampled_per_s=100.0,
                           achieved_gbps=40.0, achieved_tflops=0.1, mbu=0.4, mfu=None)
    line = stats_line(before, after, 10.0, summary)
    assert line.startswith("running: 2 reqs, waiting: 2 reqs, KV cache usage: 25.0%, "
                           "generation: 5.0 tokens/s, prefix cache hit rate: 25.0%; steps: ")
    assert "40.0 GB/s" in line and line.endswith("MBU 40.0%")  # no MFU without peak FLOP/s
