"""`rooflm profile` on a tiny random model (CPU), and the trace analysis and verdict on synthetic GPU data."""

import json
import os

import pytest
import torch

from rooflm.cli import main
from rooflm.perf import profile
from tests.models.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path, _ = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    return path


@pytest.fixture
def one_thread():
    # With 2 shared cores, intra-op threads wait on each other when other jobs run,
    # which inflates small ops' times; one thread measures the work itself.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run_profile(capsys, tiny_path, out_dir, *extra):
    rc = main(["profile", "--model", tiny_path, "--device", "cpu", "--output", str(out_dir),
               "--steps", "4", *extra])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    with open(os.path.join(out_dir, "summary.json")) as f:
        summary = json.load(f)
    return captured.out, summary


def test_profile_writes_a_trace_and_a_summary_and_calls_a_tiny_batch_cpu_bound(
        capsys, tiny_path, tmp_path, one_thread):
    text, summary = run_profile(capsys, tiny_path, tmp_path, "--batch-size", "1", "--input-len", "16")
    print(text)
    with open(tmp_path / "trace.json") as f:
        trace = json.load(f)
    names = {e.get("name") for e in trace["traceEvents"]}
    assert trace["traceEvents"]
    # The phases of a step are ranges in the trace, named by the engine's tracer hook.
    for phase in ("step", "schedule", "launch", "collect", "prepare", "forward", "sample", "process"):
        assert profile.RANGE_PREFIX + phase in names, phase
    assert any(n and n.startswith("aten::") for n in names)

    assert "CPU run: GPU figures not applicable" in text
    assert "GPU busy fraction: n/a (CPU run)" in text
    assert "wall time per step:" in text and "CPU time per step by phase" in text
    assert summary["verdict"] == "CPU/launch-bound"
    # The verdict names the overhead with its share, and both roof fractions beside it.
    line = next(l for l in text.splitlines() if l.startswith("verdict: "))
    assert line.startswith("verdict: CPU/launch-bound: ")
    assert "% of the step" in line and "of the bandwidth roof" in line and "of the FLOP roof" in line
    assert summary["cpu_compute_fraction"] < 0.5
    assert summary["mbu"] < profile.NEAR_ROOF and summary["mfu"] < profile.NEAR_ROOF
    assert "measured" in summary["peaks_source"]
    assert summary["timed_steps"] == 4 and summary["profiled_steps"] == 4
    # The automatic warm-up: the 16-token prompt in one step, then 3 decode steps.
    assert summary["warmup_steps"] == 4
    assert summary["tokens_per_step"] == 1.0
    assert summary["bytes_per_step"] > 0 and summary["kv"]["preemptions_run"] == 0
    assert set(summary["phase_ms_per_step"]) >= {"schedule", "prepare", "forward", "process"}
    assert summary["expert_load"] is None and "MoE expert load" not in text  # a dense model


@pytest.mark.parametrize("reserve", [False, True])
def test_small_kv_pool_is_kv_capacity_bound(capsys, tiny_path, tmp_path, one_thread, reserve):
    # 4 requests of 16 + 24 tokens need 10 blocks of 4 each; 12 blocks hold one at a time or so.
    # Without admission's growth reservation they preempt each other; with it they wait.
    text, summary = run_profile(capsys, tiny_path, tmp_path, "--batch-size", "4", "--input-len", "16",
                                "--output-len", "24", "--block-size", "4", "--num-blocks", "12",
                                "--warmup-steps", "2",
                                "--reserve-new-tokens" if reserve else "--no-reserve-new-tokens")
    print(text)
    if reserve:
        assert summary["kv"]["steps_waiting_on_full_pool"] > 0
        assert "waiting for KV room" in " ".join(summary["evidence"])
    else:
        assert summary["kv"]["preemptions_run"] > 0
        assert "preemption" in " ".join(summary["evidence"])
    assert summary["verdict"] == "KV-capacity-bound"
    assert "verdict: KV-capacity-bound" in text


def test_profile_leaves_the_engine_unpatched(tiny_path, tmp_path, one_thread):
    from rooflm.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_kwargs(model=tiny_path, device="cpu")
    before = list(engine._observers)  # the engine's own (the step-cost estimator)
    s = profile.profile_engine(engine, batch_size=2, input_len=8, output_len=None, steps=2,
                               warmup_steps=1, output_dir=str(tmp_path))
    assert set(s["phase_ms_per_step"]) >= {"schedule", "launch", "prepare", "forward", "process"}
    for obj, attr in [(engine.scheduler, "schedule"), (engine.runner, "launch"),
                      (engine.runner, "prepare"), (engine.runner.model, "forward"), (engine, "_process")]:
        assert attr not in vars(obj), attr
    # Uninstalled: the no-op tracer is back and no observer of the profiler's is left.
    assert engine.tracer is engine.runner.tracer and engine._observers == before
    # The engine still runs its requests to the end.
    while engine.has_unfinished_requests():
        engine.step()


def test_requests_that_end_before_the_profiled_steps_are_an_error(capsys, tiny_path, tmp_path):
    rc = main(["profile", "--model", tiny_path, "--device", "cpu", "--output", str(tmp_path),
               "--warmup-steps", "1", "--steps", "4", "--input-len", "8", "--output-len", "3"])
    assert rc == 2
    assert "--output-len" in capsys.readouterr().err


# ---- GPU-side analysis on synthetic data (no GPU here) ----------------------------------------


@pytest.mark.parametrize("name, cls", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "GEMM"),
    ("nvjet_tst_128x64_64x8_1x2_h_bz_TNT", "GEMM"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>", "GEMM"),
    ("_decode_attention_kernel", "attention"),
    ("_prefill_attention_kernel", "attention"),
    ("flash_fwd_kernel", "attention"),
    ("_rmsnorm_kernel", "norm/elementwise"),
    ("_silu_mul_kernel", "norm/elementwise"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctorOnSelf_add<float>>",
     "norm/elementwise"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::exponential_kernel>", "sampling"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>",
     "sampling"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>", "sampling"),
    ("Memcpy HtoD (Pinned -> Device)", "memcpy"),
    ("void at::native::indexSelectLargeIndex<float>", "other"),
])
def test_kernel_classes(name, cls):
    assert profile.classify_kernel(name) == cls


def test_device_trace_busy_fraction_is_the_union_of_kernels_over_the_step_window():
    us = [
        {"ph": "X", "cat": "user_annotation", "name": "rooflm.step", "ts": 1000, "dur": 100},
        {"ph": "X", "cat": "user_annotation", "name": "rooflm.step", "ts": 1100, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "nvjet_gemm", "ts": 1010, "dur": 40},
        {"ph": "X", "cat": "kernel", "name": "_decode_attention_kernel", "ts": 1040, "dur": 20},  # overlaps
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 1150, "dur": 10},
        {"ph": "X", "cat": "kernel", "name": "_rmsnorm_kernel", "ts": 1195, "dur": 20},  # clipped at 1200
        {"ph": "X", "cat": "kernel", "name": "before_window", "ts": 900, "dur": 50},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1010, "dur": 30},
    ]
    dev = profile.analyse_device_trace({"traceEvents": us})
    assert dev["window_us"] == 200
    assert dev["busy_us"] == 50 + 10 + 5
    assert dev["busy_fraction"] == pytest.approx(65 / 200)
    assert dev["by_class_us"]["GEMM"] == 40
    assert dev["by_class_us"]["attention"] == 20
    assert dev["by_class_us"]["memcpy"] == 10
    assert dev["by_class_us"]["idle gaps"] == 135
    assert profile.analyse_device_trace({"traceEvents": us[:2]}) is None


def test_device_window_follows_the_launched_work_under_async_scheduling():
    """Async scheduling: each host step launches the next step's kernels and returns after collecting
    the previous one's, so the profiled steps' kernels run after their host ranges. The window is
    the GPU-side mirror of the launch ranges, not the host steps."""
    us = [
        {"ph": "X", "cat": "user_annotation", "name": "rooflm.step", "ts": 1000, "dur": 100},
        {"ph": "X", "cat": "user_annotation", "name": "rooflm.step", "ts": 1100, "dur": 100},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "rooflm.launch", "ts": 1050, "dur": 100},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "rooflm.launch", "ts": 1150, "dur": 120},
        {"ph": "X", "cat": "kernel", "name": "fp8_decode_attention", "ts": 1050, "dur": 90},
        {"ph": "X", "cat": "kernel", "name": "fp8_decode_attention", "ts": 1150, "dur": 90},
        {"ph": "X", "cat": "kernel", "name": "nvjet_gemm", "ts": 1240, "dur": 30},  # past the host steps
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 1180, "dur": 40},
    ]
    dev = profile.analyse_device_trace({"traceEvents": us})
    assert dev["window_us"] == 220
    assert dev["by_class_us"]["attention"] == 180 and dev["by_class_us"]["GEMM"] == 30
    assert dev["by_class_us"]["idle gaps"] == 10
    assert dev["sync_us"] == 20  # host syncs still count inside the host steps only


def gpu_summary(busy, mbu, mfu, preemptions=0, gemm_share=None):
    """A GPU run's summary as _summarise builds it, for a window of 1000 us over 10 steps."""
    window = 1000.0
    idle = (1 - busy) * window
    gemm = busy * window * 0.9 if gemm_share is None else gemm_share * window
    small = busy * window - gemm
    return {"cpu_run": False, "gpu_busy_fraction": busy, "profiled_steps": 10, "gpu": "H100",
            "device_trace": {"window_us": window, "sync_us": 30.0,
                             "by_class_us": {"idle gaps": idle, "GEMM": gemm,
                                             "norm/elementwise": small}},
            "kv": {"preemptions_run": preemptions, "preemptions_measured": 0,
                   "steps_waiting_on_full_pool": 0, "peak_usage": 0.5, "num_blocks": 100,
                   "block_size": 16},
            "mbu": mbu, "mfu": mfu, "peak_gbps": 3350.0, "peak_tflops": 989.0,
            "bytes_per_step": 16e9, "flops_per_step": 1e12, "achieved_gbps": 2000.0,
            "achieved_gflops": 1e5}


@pytest.mark.parametrize("busy, mbu, mfu, preemptions, verdict", [
    (0.45, 0.2, 0.01, 0, "CPU/launch-bound"),
    (0.95, 0.7, 0.05, 0, "memory-bound"),
    (0.95, 0.3, 0.6, 0, "compute-bound"),
    (0.45, 0.2, 0.01, 3, "KV-capacity-bound"),
    # Busy, but the GEMMs run at 18% of bandwidth: the kernels are the limit, not memory.
    (0.95, 0.18, 0.07, 0, "kernel-bound"),
])
def test_gpu_verdicts(busy, mbu, mfu, preemptions, verdict):
    s = gpu_summary(busy, mbu, mfu, preemptions)
    v, evidence = profile._verdict(s, "bf16")
    assert v == verdict
    assert evidence
    # The fraction of each roof is always printed next to the word.
    assert s["verdict_line"].startswith(verdict)
    assert f"{mbu:.0%} of the bandwidth roof, {mfu:.0%} of the FLOP roof" in s["verdict_line"]


def test_far_from_both_roofs_is_never_memory_bound():
    # The step: 18% of bandwidth, 7% of the FLOP rate, most of the step in launch gaps.
    s = gpu_summary(0.4, 0.18, 0.07)
    v, evidence = profile._verdict(s, "bf16")
    assert v == "CPU/launch-bound"
    assert "launch gaps" in s["verdict_line"] and "60% of the step" in s["verdict_line"]
    text = "\n".join(evidence)
    assert "the host waited 0.003 ms in device syncs" in text  # 30 us over 10 steps
    assert "both under 50%" in text
    # Near a roof the bound is that roof, whatever the gaps.
    s = gpu_summary(0.85, 0.55, 0.07)
    assert profile._verdict(s, "bf16")[0] == "memory-bound"


def test_time_shares_account_for_the_whole_step():
    s = gpu_summary(0.8, 0.3, 0.05, gemm_share=0.6)
    shares = dict((what.split(" (")[0], share) for what, share, _ in profile.time_shares(s))
    assert shares["launch gaps"] == pytest.approx(0.2)
    assert shares["small kernels"] == pytest.approx(0.2)
    # GEMM time over the step's floor (30% of the step at the bandwidth roof).
    assert shares["the matmul and attention kernels below the roofs"] == pytest.approx(0.3)
