"""`rooflm bench latency` and `rooflm bench throughput` end to end on a tiny random model (CPU).

The tiny model has no tokenizer, so every prompt is token ids. The tests check
that the commands run, that the JSON they write has the expected keys, and
that counts equal what was asked and rates are positive; no test asserts a time.
"""

import json
import math

import pytest
import torch

from rooflm.cli import build_parser, main
from tests.models.tiny_models import make_tiny_model

STAMP_KEYS = {"date", "cpu", "torch", "git_commit", "command", "device", "device_name",
              "load_average_1_5_15min"}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path, _ = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    return path


@pytest.fixture(autouse=True)
def one_thread():
    # With 2 shared cores, intra-op threads wait on each other when other jobs run,
    # and a step of the tiny model goes from milliseconds to hundreds of them.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run_bench(capsys, *argv):
    rc = main(["bench", *argv, "--device", "cpu", "--disable-tqdm"])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def read_json(path):
    with open(path) as f:
        return json.load(f)


# ---------------------------------------------------------------- latency


def test_latency_reports_ttft_tpot_and_mbu(capsys, tmp_path, tiny_path):
    out_json, out_md = tmp_path / "latency.json", tmp_path / "latency.md"
    rc, out, err = run_bench(capsys, "latency", "--model", tiny_path, "--batch-size", "3",
                             "--input-len", "8", "--output-len", "5", "--num-iters", "2",
                             "--num-iters-warmup", "1", "--cpu-bandwidth-gbs", "20",
                             "--output-json", str(out_json), "--output-md", str(out_md))
    assert rc == 0, err
    result = read_json(out_json)
    assert STAMP_KEYS <= result.keys()
    assert result["benchmark"] == "latency"
    assert (result["batch_size"], result["input_len"], result["output_len"]) == (3, 8, 5)
    assert len(result["iterations"]) == 2
    assert result["output_tokens_per_iter"] == result["expected_output_tokens_per_iter"] == 15
    for it in result["iterations"]:
        assert it["output_tokens"] == 15
        assert it["cached_prompt_tokens"] == 0  # fresh prompts every iteration
        assert 0 < it["ttft_s"] <= it["e2e_s"]
        assert it["tpot_s"] > 0
    for key in ("ttft_ms", "tpot_ms", "e2e_latency_ms", "output_tokens_per_s"):
        stats = result[key]
        assert stats["min"] <= stats["median"] <= stats["max"]
        assert stats["median"] > 0
    # The decode step reads at least every weight once: 2 layers of hidden 64, fp32.
    assert result["decode_weight_bytes"] > 0
    assert result["decode_bytes_per_step"] > result["decode_weight_bytes"]
    assert result["bandwidth_gbs"] == 20
    assert 0 < result["mbu"] < 1  # a CPU step of a tiny model is far from the bandwidth floor
    assert "MBU:" in out and "Median TPOT (ms):" in out
    assert "| batch |" in out_md.read_text()


def test_latency_sweeps_context_lengths_beside_the_prefill_floor(capsys, tmp_path, tiny_path):
    # --gpu h100 is refused for a CPU run; a measured CPU has FLOP rates, so floors exist.
    out_json = tmp_path / "sweep.json"
    rc, out, err = run_bench(capsys, "latency", "--model", tiny_path, "--batch-size", "2",
                             "--input-len", "5", "40", "--output-len", "3", "--num-iters", "1",
                             "--num-iters-warmup", "0", "--max-num-batched-tokens", "16",
                             "--output-json", str(out_json))
    assert rc == 0, err
    result = read_json(out_json)
    assert result["input_len"] == [5, 40]
    points = result["sweep"]
    assert [p["input_len"] for p in points] == [5, 40]
    for p in points:
        assert p["output_tokens_per_iter"] == 6
        assert 0 < p["ttft_floor_ms"] and p["ttft_ms"]["median"] > 0
        assert p["decode_floor_ms"] > 0
    # Two prompts of 40 in chunks of 16 take 5 chunks, of 5 one: more FLOPs and more weight reads.
    assert points[1]["ttft_floor_ms"] > points[0]["ttft_floor_ms"]
    assert "TTFT ms" in out and "    40 " in out


def test_prefill_floor_counts_each_chunk_of_the_schedule(tiny_path):
    import dataclasses
    from types import SimpleNamespace

    from rooflm.bench.latency import prefill_floor_s
    from rooflm.engine.llm_engine import LLMEngine
    from rooflm.perf.gpus import get_gpu

    engine = LLMEngine.from_kwargs(model=tiny_path, device="cpu", max_num_batched_tokens=8)
    h100 = get_gpu("h100")
    one_chunk = prefill_floor_s(engine, 1, 8, h100)
    # 16 tokens in two chunks of 8 read the weights twice: more than in one chunk of 16.
    wide = SimpleNamespace(info=dataclasses.replace(engine.info, max_num_batched_tokens=16))
    assert prefill_floor_s(engine, 1, 16, h100) > prefill_floor_s(wide, 1, 16, h100) > one_chunk
    # Two prompts of 4 fill one chunk of 8: cheaper than two chunks.
    assert prefill_floor_s(engine, 2, 4, h100) < 2 * one_chunk
    cpu_without_flops = SimpleNamespace(peak_flops=lambda dtype: (_ for _ in ()).throw(KeyError(dtype)))
    assert prefill_floor_s(engine, 1, 8, cpu_without_flops) is None


def test_latency_input_len_sweep_and_bad_lengths():
    from rooflm.bench.latency import resolve_input_lens

    assert resolve_input_lens(["sweep"], 1024, 24) == [128, 256, 512, 1000]
    assert resolve_input_lens(["sweep"], 64, 8) == [56]
    assert resolve_input_lens(["7", "9"], 64, 8) == [7, 9]
    for bad, msg in [(["x"], "integers or 'sweep'"), (["0"], ">= 1"), (["60"], "over --max-model-len")]:
        with pytest.raises(ValueError, match=msg):
            resolve_input_lens(bad, 64, 8)


def test_latency_measures_the_cpu_as_profile_does(capsys, tmp_path, tiny_path):
    # No --cpu-bandwidth-gbs: the CPU is measured by the one module that `profile` and
    # `roofline --gpu measure` use too (perf/gpus.py), once per process.
    from rooflm.perf.gpus import measure_host

    out_json = tmp_path / "latency.json"
    rc, out, err = run_bench(capsys, "latency", "--model", tiny_path, "--batch-size", "1",
                             "--input-len", "4", "--output-len", "2", "--num-iters", "1",
                             "--num-iters-warmup", "0", "--output-json", str(out_json))
    assert rc == 0, err
    result = read_json(out_json)
    host = measure_host("cpu")  # cached: the same measurement the bench used
    assert result["bandwidth_gbs"] == pytest.approx(host.mem_bw_gbs)
    assert result["bandwidth_source"].startswith("measured")
    assert 0 < result["mbu"] < 1
    assert result["output_tokens_per_iter"] == 2
    assert "MBU:" in out and "n/a" not in out


def test_latency_refuses_a_gpu_peak_for_a_cpu_run(capsys, tiny_path):
    rc, _, err = run_bench(capsys, "latency", "--model", tiny_path, "--batch-size", "1",
                           "--input-len", "4", "--output-len", "2", "--num-iters", "1",
                           "--gpu", "h100")
    assert rc == 2
    assert "--cpu-bandwidth-gbs" in err


def test_latency_on_a_dummy_preset(capsys, tmp_path):
    # SmolLM2's exact shape with random weights: ~1 s to build, ~0.1 s per step on one thread.
    out_json = tmp_path / "latency.json"
    rc, _, err = run_bench(capsys, "latency", "--model", "smollm2-135m", "--load-format", "dummy",
                           "--cpu-kv-cache-gb", "0.05", "--batch-size", "1", "--input-len", "4",
                           "--output-len", "2", "--num-iters", "1", "--num-iters-warmup", "0",
                           "--output-json", str(out_json))
    assert rc == 0, err
    result = read_json(out_json)
    assert result["output_tokens_per_iter"] == 2
    # ~135M fp32 parameters are read every decode step.
    assert result["decode_weight_bytes"] > 4 * 100e6


# ---------------------------------------------------------------- throughput


def test_throughput_counts_rates_and_bound(capsys, tmp_path, tiny_path):
    out_json, out_md = tmp_path / "throughput.json", tmp_path / "throughput.md"
    rc, out, err = run_bench(capsys, "throughput", "--model", tiny_path, "--num-prompts", "6",
                             "--input-len", "8", "--output-len", "4", "--range-ratio", "0.5",
                             "--gpu", "h100", "--output-json", str(out_json),
                             "--output-md", str(out_md))
    assert rc == 0, err
    result = read_json(out_json)
    assert STAMP_KEYS <= result.keys()
    assert result["benchmark"] == "throughput"
    assert result["num_prompts"] == result["num_completed"] == 6
    assert result["total_output_tokens"] == result["expected_output_tokens"]
    # Lengths are drawn in [len*(1-r), len*(1+r)]: 6 prompts of 4..12 tokens, outputs of 2..6.
    assert 6 * 4 <= result["total_prompt_tokens"] <= 6 * 12
    assert 6 * 2 <= result["total_output_tokens"] <= 6 * 6
    assert result["requests_per_s"] > 0
    assert result["output_tokens_per_s"] > 0
    assert result["total_tokens_per_s"] > result["output_tokens_per_s"]
    assert result["num_preemptions"] == 0

    bound = result["bound"]
    assert bound["gpu"].startswith("NVIDIA H100")
    assert bound["decode_concurrency"] == 6  # the pool holds more: capped by the requests
    assert bound["prefill_floor_s"] > 0 and bound["decode_floor_s"] > 0
    assert math.isclose(bound["output_tokens_per_s"],
                        result["total_output_tokens"] / (bound["prefill_floor_s"] + bound["decode_floor_s"]))
    # A tiny model on the CPU against an H100's roof is a tiny fraction of it.
    assert 0 < result["fraction_of_bound"] < 1
    assert "Bound on output tokens/s:" in out and "what-if" in out
    assert bound["serial_output_tokens_per_s"] <= bound["output_tokens_per_s"] * (1 + 1e-9)
    assert "| requests |" in out_md.read_text()


def test_throughput_with_a_small_kv_pool_preempts_and_still_completes(capsys, tmp_path, tiny_path):
    # 6 blocks of 4 tokens: one request of 8 + 8 tokens needs 4 blocks, so 4 at once must
    # preempt (with admission's growth reservation off: it would keep them from starting).
    out_json = tmp_path / "throughput.json"
    rc, _, err = run_bench(capsys, "throughput", "--model", tiny_path, "--num-prompts", "4",
                           "--input-len", "8", "--output-len", "8", "--block-size", "4",
                           "--num-blocks", "6", "--no-reserve-new-tokens", "--output-json", str(out_json))
    assert rc == 0, err
    result = read_json(out_json)
    assert result["num_completed"] == 4
    assert result["total_output_tokens"] == result["expected_output_tokens"] == 32
    assert result["num_preemptions"] > 0
    assert result["bound"] is None  # CPU, no --gpu: no analytic bound


def test_throughput_sharegpt_needs_a_tokenizer(capsys, tmp_path, tiny_path):
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi there " * 4},
                                                      {"from": "gpt", "value": "hello " * 8}]}]))
    rc, _, err = run_bench(capsys, "throughput", "--model", tiny_path, "--num-prompts", "1",
                           "--dataset", str(dataset))
    assert rc == 2
    assert "tokenizer" in err


def test_bench_has_serve_too():
    args = build_parser().parse_args(["bench", "serve", "--base-url", "http://127.0.0.1:1",
                                      "--model", "m"])
    assert args.func.__name__ == "run_serve"


def test_throughput_breakdown_accounts_every_step(tiny_path, tmp_path, capsys):
    out_json = tmp_path / "breakdown.json"
    rc, out, err = run_bench(capsys, "throughput", "--model", tiny_path, "--num-prompts", "6",
                             "--input-len", "8", "--output-len", "4", "--range-ratio", "0.5",
                             "--gpu", "h100", "--breakdown", "--output-json", str(out_json))
    assert rc == 0, err
    result = read_json(out_json)
    kinds = result["breakdown"]
    assert kinds and sum(k["steps"] for k in kinds.values()) == result["num_steps"]
    for name, k in kinds.items():
        # Operations one after another never take less than all of them overlapped.
        assert 0 < k["floor_s"] <= k["serial_floor_s"] * (1 + 1e-9), name
        assert sum(b["steps"] for b in k["by_batch"].values()) == k["steps"]
    assert "Step breakdown" in out and "serial" in out
