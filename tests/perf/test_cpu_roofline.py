"""`rooflm roofline` on a CPU speaks of the CPU (SIMD FMA, DRAM, its measured roofs) and prices the
precision the CPU engine runs: the default model's Q4_1 blocks at 5 bits a weight with int8
activations, its Q8_0 tied head, fp32 activations and KV (issue 52), with the int8 roof the native
block kernels' own measured rate. Here, the model's inputs; the bound against a measured decode step
is tests/models/test_cpu_roofline_measured.py."""

import io

import pytest

from rooflm.cli import build_parser
from rooflm.perf.commands import ResolvedModel, default_weight_format, gguf_embedding_bytes, resolve_model
from rooflm.perf.gpus import GpuSpec, get_gpu
from rooflm.perf.roofline import WEIGHT_FORMATS, engine_precision, phase_step_cost, summarize

# A CPU of known roofs, so the arithmetic below is exact: 20 GB/s of DRAM, 100 GFLOP/s.
CPU = GpuSpec(key="cpu", name="test CPU", peak_tflops={"fp32": 0.1, "bf16": 0.02, "int8": 0.1},
              mem_bw_gbs=20.0, device="cpu", source="test")


@pytest.fixture(scope="module")
def default_model():
    return resolve_model(None)


def test_the_default_model_is_priced_at_its_gguf_blocks(default_model):
    assert default_model.gguf_path.endswith("Q4_1.gguf")
    dtype = default_weight_format(default_model, on_cpu=True)
    assert dtype == "q4_1"
    assert 8 * WEIGHT_FORMATS[dtype].bytes_per_param == 5.0  # 4-bit codes + an fp16 scale and min a 32
    assert 8 * gguf_embedding_bytes(default_model.gguf_path) == 8.5  # the tied head: Q8_0
    precision = engine_precision(dtype, on_cpu=True)
    assert precision.compute_dtype == "int8" and precision.act_bytes == 4.0
    assert "int8 activations" in precision.note and "5 bits" in precision.note


def test_a_float_model_on_a_cpu_runs_in_fp32():
    assert default_weight_format(ResolvedModel("llama-3-8b", None, None), on_cpu=True) == "fp32"
    assert default_weight_format(ResolvedModel("llama-3-8b", None, None)) == "bf16"
    assert engine_precision("fp32", on_cpu=True).compute_dtype == "fp32"
    assert engine_precision("q4_1").compute_dtype == "bf16"  # on a GPU: W4A16


def test_the_cpu_step_reads_the_q4_1_layers_and_the_q8_0_head(default_model):
    config = default_model.config
    cpu = phase_step_cost(config, "decode", 1, 160, weight_dtype="q4_1", kv_dtype="fp32",
                          precision=engine_precision("q4_1", on_cpu=True), head_bytes=34 / 32)
    gpu = phase_step_cost(config, "decode", 1, 160, weight_dtype="q4_1", kv_dtype="bf16")
    head = next(op for op in cpu.ops if op.name == "lm_head")
    assert head.weight_bytes == pytest.approx(config.hidden_size * config.vocab_size * 34 / 32)
    layers = sum(op.weight_bytes for op in cpu.ops if op.name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    h, q, kv, inter = config.hidden_size, config.q_size, config.num_key_value_heads * config.head_dim, \
        config.intermediate_size
    linear_params = config.num_hidden_layers * (h * (q + 2 * kv) + q * h + 3 * h * inter)
    assert layers == pytest.approx(linear_params * 20 / 32)  # Q4_1: 20 bytes a block of 32
    assert cpu.compute_dtype == "int8"
    # fp32 KV: twice the bf16 cache read of the same context.
    kv = sum(op.kv_bytes for op in cpu.ops)
    assert kv == pytest.approx(2 * sum(op.kv_bytes for op in gpu.ops))
    s = summarize(cpu, CPU)
    assert s.memory_bound_s == s.floor_s  # batch 1 on DRAM: every op waits on memory
    assert s.tokens_per_s == pytest.approx(20e9 / cpu.bytes, rel=1e-9)


def test_roofline_on_a_cpu_speaks_of_the_cpu(monkeypatch):
    from rooflm.perf import commands

    monkeypatch.setattr(commands, "get_gpu", lambda name: CPU)
    args = build_parser().parse_args(["roofline", "--gpu", "cpu", "--context", "160"])
    out = io.StringIO()
    assert args.func(args, out=out) == 0
    text = out.getvalue()
    assert "weights q4_1 (GGUF Q4_1 blocks, 5 bits a weight" in text and "KV fp32" in text
    assert "SIMD FMA" in text and "DRAM 20.0 GB/s" in text and "wait on DRAM" in text
    for gpu_word in ("tensor cores", "CUDA cores", "HBM", "TB/s"):
        assert gpu_word not in text, gpu_word
    bound = float(text.split("at most ")[1].split(" output tokens/s")[0].replace(",", ""))
    assert bound > 0


def test_cpu_is_a_device_choice_and_a_measured_cpu_is_one(monkeypatch):
    from rooflm.perf import gpus

    monkeypatch.setattr(gpus, "_cache", {})
    measured = get_gpu("cpu")
    assert measured.is_cpu and measured.mem_bw_gbs > 0 and measured.peak_flops("int8") > 0
    assert measured.compute_roof_name("int8") == "int8 SIMD dot" and measured.memory_name == "DRAM"
    # The int8 roof is the native block kernels' rate, not the fp32 FMA's taken for it.
    assert "native int8 block dot" in measured.source
    assert measured.peak_flops("int8") != measured.peak_flops("fp32")
    assert not get_gpu("h100").is_cpu and get_gpu("h100").memory_name == "HBM"


def test_the_block_kernels_one_token_rate_prices_a_small_decode(default_model):
    """Below the kernel's tile of 4 tokens a row, every token unpacks the weight blocks again: a
    decode of 1-3 sequences runs at the one-token rate, 4 and more at the tile's."""
    from rooflm.perf.gpus import BLOCK_DOT_TILE, INT8_ONE_TOKEN
    from rooflm.perf.roofline import layer_roof, roofline

    slow = GpuSpec(key="cpu", name="test CPU", peak_tflops={"fp32": 0.1, "int8": 0.04, INT8_ONE_TOKEN: 0.01},
                   mem_bw_gbs=1000.0, device="cpu", source="test")  # DRAM out of the way: compute decides
    precision = engine_precision("q4_1", on_cpu=True)
    for batch, rate in ((1, 0.01), (BLOCK_DOT_TILE - 1, 0.01), (BLOCK_DOT_TILE, 0.04)):
        step = phase_step_cost(default_model.config, "decode", batch, 64, weight_dtype="q4_1", kv_dtype="fp32",
                               precision=precision)
        gate_up = next(r for r in roofline(step, slow) if r.op.name == "gate_up_proj")
        assert gate_up.peak_flops == rate * 1e12, batch
        assert slow.peak_flops(layer_roof(step, slow)) == rate * 1e12
    # The roof of one token a row is a CPU's only: a GPU's int8 stays its own.
    assert layer_roof(step, get_gpu("h100")) == "int8"
