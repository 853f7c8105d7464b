"""The roofline model against hand-computed cases."""

import argparse
import math
import io

import pytest
import torch

from rooflm.config import ModelConfig
from rooflm.model.presets import get_preset
from rooflm.perf import commands
from rooflm.perf.gpus import GPUS, get_gpu, measure_gpu
from rooflm.perf.roofline import (
    causal_pairs,
    layernorm_cost,
    matmul_cost,
    op_roofline,
    phase_step_cost,
    roofline,
    step_cost,
    summarize,
    verdict,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# A tiny model whose numbers are easy to compute by hand.
TINY = ModelConfig(architecture="LlamaForCausalLM", vocab_size=1000, hidden_size=64,
                   intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16)


def _op(step, name):
    return next(op for op in step.ops if op.name == name)


def test_ridge_points_of_the_datasheets():
    assert round(get_gpu("a100").ridge_point("bf16")) == 156  # 312 TFLOP/s / 2.0 TB/s
    assert round(get_gpu("h100").ridge_point("bf16")) == 295  # 989 / 3.35
    # Formats a GPU lacks fall back to what it would really run: fp8 on A100 is bf16.
    assert get_gpu("a100").peak_flops("fp8") == get_gpu("a100").peak_flops("bf16")
    assert get_gpu("h100-measured").peak_flops("bf16") == 759e12
    assert get_gpu("h100-measured").mem_bw == 3008e9
    for key in ("v100", "a100", "h100", "h200", "b200", "l4", "rtx4090", "orin"):
        assert key in GPUS


def test_layernorm_is_memory_bound_and_a_4096_cubed_matmul_compute_bound():
    a100 = get_gpu("a100")
    ln = layernorm_cost(4096, 4096, elem_bytes=2)
    assert ln.intensity < 2  # ~7 FLOPs per element over 4 bytes moved per element
    assert op_roofline(ln, a100).bound == "memory"

    mm = matmul_cost(4096, 4096, 4096, elem_bytes=2)
    assert mm.flops == 2 * 4096**3
    assert mm.bytes == 3 * 4096 * 4096 * 2
    assert mm.intensity == pytest.approx(4096 / 3)  # 1365 FLOP/B >> 156
    for gpu in ("a100", "h100"):
        assert op_roofline(mm, get_gpu(gpu)).bound == "compute"


def test_decode_step_by_hand():
    # 3 sequences decoding, 10 + 20 + 30 positions attended.
    step = step_cost(TINY, num_decode_seqs=3, decode_context_tokens=60, weight_bytes=2, kv_bytes=2)
    h, q, kv, inter, layers, vocab = 64, 64, 32, 128, 2, 1000
    qkv = _op(step, "qkv_proj")
    assert qkv.flops == layers * 2 * 3 * h * (q + 2 * kv)
    assert qkv.weight_bytes == layers * h * (q + 2 * kv) * 2
    attn = _op(step, "attention")
    assert attn.flops == layers * 4 * q * 60  # QK^T and PV over every attended position
    assert attn.kv_bytes == layers * 60 * 2 * kv * 2  # K and V once per KV head (GQA shares)
    assert _op(step, "gate_up_proj").flops == layers * 2 * 3 * h * 2 * inter
    assert _op(step, "down_proj").flops == layers * 2 * 3 * inter * h
    lm = _op(step, "lm_head")
    assert lm.flops == 2 * 3 * h * vocab
    assert step.num_tokens == 3 and step.num_sampled == 3
    assert step.flops == pytest.approx(sum(op.flops for op in step.ops))


def test_prefill_attention_is_causal_and_lm_head_only_on_sampled_tokens():
    s = 512
    step = step_cost(TINY, prefill_tokens=s, num_sampled_prefills=1)
    dense = 4 * s * s * 16 * 4 * 2  # 4 * S^2 * D * H, times layers
    assert _op(step, "attention").flops == pytest.approx(dense / 2, rel=1 / s)
    # One sampled row: the LM head is a [1, h] x [h, V] matmul, not [S, h] x [h, V].
    assert _op(step, "lm_head").flops == 2 * 64 * 1000
    # A chunk that ends mid-prompt samples nothing and never reads the LM head.
    mid = step_cost(TINY, prefill_tokens=s, num_sampled_prefills=0)
    assert _op(mid, "lm_head").bytes == 0 and _op(mid, "sampling").flops == 0


def test_causal_pairs():
    assert causal_pairs(4) == 1 + 2 + 3 + 4
    assert causal_pairs(2, num_cached=10) == 11 + 12
    assert causal_pairs(5, window=3) == 1 + 2 + 3 + 3 + 3
    assert causal_pairs(3, num_cached=1, window=3) == 2 + 3 + 3
    brute = sum(min(7 + i + 1, 9) for i in range(6))
    assert causal_pairs(6, num_cached=7, window=9) == brute


def test_llama3_8b_batch1_decode_on_h100_is_memory_bound_at_about_200_tokens_per_s():
    config = get_preset("llama-3-8b")
    h100 = get_gpu("h100")
    step = phase_step_cost(config, "decode", batch_size=1, context=1024)
    summary = summarize(step, h100)
    # Every linear weight and the LM head, once: 8.03B params minus the 0.53B embedding table.
    assert summary.weight_bytes == pytest.approx(2 * (config.num_params() - 128256 * 4096), rel=1e-3)
    assert 15.0e9 < step.bytes < 16.1e9
    assert 200 < summary.tokens_per_s < 230
    assert summary.matmul_intensity == pytest.approx(1.0, rel=0.01)  # 2 FLOPs per 2-byte weight
    assert all(r.bound == "memory" for r in roofline(step, h100))
    text = verdict(step, h100, "decode", 2.0)
    assert "memory-bound" in text and "295" in text
    # On the project's measured H100 the floor is the ~5 ms, ~200 tokens/s of DESIGN.md.
    measured = summarize(step, get_gpu("h100-measured"))
    assert 4.8e-3 < measured.floor_s < 5.3e-3


def test_large_prefill_is_compute_bound():
    step = phase_step_cost(get_preset("llama-3-8b"), "prefill", batch_size=4, context=2048)
    a100 = get_gpu("a100")
    assert summarize(step, a100).compute_bound_s > summarize(step, a100).memory_bound_s
    assert "compute-bound" in verdict(step, a100, "prefill", 2.0)


def test_quantization_and_tensor_parallelism():
    config = get_preset("llama-3-8b")
    bf16 = phase_step_cost(config, "decode", 1, 1024)
    int4 = phase_step_cost(config, "decode", 1, 1024, weight_dtype="int4")
    assert int4.compute_dtype == "bf16"  # weight-only: the matmuls still run in bf16
    assert summarize(int4, get_gpu("h100")).weight_bytes < 0.3 * summarize(bf16, get_gpu("h100")).weight_bytes
    tp2 = phase_step_cost(config, "decode", 1, 1024, tp=2)
    assert _op(tp2, "qkv_proj").weight_bytes == _op(bf16, "qkv_proj").weight_bytes / 2
    assert _op(tp2, "tp all-reduce").bytes > 0 and tp2.comm_bytes > 0
    with pytest.raises(ValueError):
        phase_step_cost(config, "decode", 1, 1024, tp=3)


def test_mbu_and_mfu():
    step = phase_step_cost(get_preset("llama-3-8b"), "decode", 8, 512)
    h100 = get_gpu("h100")
    assert step.mbu(step.bytes / h100.mem_bw, h100) == pytest.approx(1.0)
    assert step.mbu(2 * step.bytes / h100.mem_bw, h100) == pytest.approx(0.5)
    assert step.mfu(step.flops / h100.peak_flops("bf16"), h100) == pytest.approx(1.0)


def _parse(argv):
    parser = argparse.ArgumentParser()
    commands.register(parser.add_subparsers())
    return parser.parse_args(argv)


def test_roofline_command_prints_one_screen_and_plots(tmp_path):
    png = tmp_path / "roofline.png"
    args = _parse(["roofline", "--model", "llama-3-8b", "--gpu", "h100", "--batch-size", "1",
                   "--phase", "decode", "--plot", str(png)])
    out = io.StringIO()
    assert args.func(args, out=out) == 0
    text = out.getvalue()
    for needle in ("qkv_proj", "attention", "o_proj", "gate_up_proj", "act (silu*mul)", "down_proj",
                   "norms", "residual adds", "lm_head", "sampling", "step floor", "tokens/s",
                   "ridge point", "memory-bound"):
        assert needle in text, needle
    assert len(text.splitlines()) < 45
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_roofline_command_rejects_unknown_model():
    args = _parse(["roofline", "--model", "no-such-model"])
    assert args.func(args, out=io.StringIO()) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")
def test_measure_without_a_gpu_says_so():
    with pytest.raises(RuntimeError, match="CUDA"):
        measure_gpu()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU measurement")
def test_roofline_gpu_measure_on_a_cpu_measures_this_cpu():
    # One measurement for `roofline --gpu measure`, `profile` and `bench` (perf/gpus.py).
    from rooflm.perf.gpus import measure_host

    args = _parse(["roofline", "--model", "smollm2-135m", "--gpu", "measure", "--phase", "decode"])
    out = io.StringIO()
    assert args.func(args, out=out) == 0
    host = measure_host()
    assert host is measure_host("cpu")  # cached: every consumer sees the same roofs
    assert host.key == "cpu" and "measured" in host.source
    assert 1 < host.mem_bw_gbs < 1000 and 1e9 < host.peak_flops("fp32") < 1e14
    assert host.peak_flops("bf16") > 0
    assert host.source in out.getvalue()


@pytest.mark.gpu
def test_measure_gpu_on_a_gpu():
    gpu = measure_gpu(repeats=5)
    assert gpu.mem_bw > 1e11 and gpu.peak_flops("bf16") > 1e13


def test_plot_merges_overlapping_ops_and_sizes_them_by_time_share(tmp_path):
    from rooflm.perf.plot import group_points, marker_area, plot_roofline
    from rooflm.perf.roofline import roofline

    gpu = get_gpu("h100")
    step = step_cost(get_preset("llama-3-8b"), num_decode_seqs=1, decode_context_tokens=1024)
    rows = roofline(step, gpu)
    groups = group_points(rows)
    # Batch-1 decode: the weight matmuls all sit at ~1 FLOP/B on the bandwidth roof: one point.
    matmuls = next(g for g in groups if "qkv_proj" in g.names)
    assert {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"} <= set(matmuls.names)
    assert matmuls.short_label == f"{len(matmuls.names)} matmuls"
    assert "qkv_proj" in matmuls.label and "down_proj" in matmuls.label
    # Every op with FLOPs is in exactly one group, and no two groups overprint.
    names = [n for g in groups for n in g.names]
    assert sorted(names) == sorted(r.op.name for r in rows if r.op.flops > 0 and r.op.kind != "comm")
    for a in groups:
        for b in groups:
            if a is not b:
                assert not (abs(math.log10(a.intensity / b.intensity)) < 0.06
                            and abs(math.log10(a.tflops / b.tflops)) < 0.06)
    # Shares of the step's floor time: the matmuls read the weights, most of a decode step.
    assert groups[0] is matmuls and matmuls.share > 0.8
    assert sum(g.share for g in groups) <= 1.0 + 1e-9
    assert marker_area(matmuls.share) > marker_area(groups[-1].share)
    png = tmp_path / "decode.png"
    plot_roofline(rows, gpu, str(png))
    assert png.read_bytes()[:8] == PNG_MAGIC
