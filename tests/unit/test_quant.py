"""rooflm.quant: GGUF blocks decoded exactly, and the quantized linears against a float32
reference (relative error at bf16 level for torch's kernels, which take bf16 activations; far
below it for rooflm's native kernels, which split them into two int8 levels per block of 32)."""

import numpy as np
import pytest
import torch

from rooflm.layers.linear import FusedLinear, Linear
from rooflm.quant.gguf_blocks import BlockTensor, decode
from rooflm.quant import native
from rooflm.quant.linear_method import (Int4GroupLinear, Int8BlockLinear, Int8RowLinear,
                                        NativeBlockLinear, cpu_kernels_available,
                                        make_quantized_linear)

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

FORMATS = ["Q4_0", "Q4_1", "Q8_0"]

needs_kernels = pytest.mark.skipif(not cpu_kernels_available(),
                                   reason="this torch lacks the CPU weight-only kernels")
needs_native = pytest.mark.skipif(native.library() is None,
                                  reason="no C compiler or no AVX2/FMA: native kernels not built")


@pytest.fixture
def torch_kernels(monkeypatch):
    """make_quantized_linear as on a machine without the native kernels."""
    monkeypatch.setattr(native, "library", lambda: None)


def quantized(fmt, rows, cols, seed):
    """Random weights through gguf's own quantizer: (raw block bytes, gguf's dequantization)."""
    rng = np.random.default_rng(seed)
    weights = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    qtype = GGMLQuantizationType[fmt]
    raw = gguf_quants.quantize(weights, qtype)
    return raw, torch.from_numpy(gguf_quants.dequantize(raw, qtype)).reshape(rows, cols)


def rel_err(out, ref):
    assert not torch.isnan(out).any()
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_gives_ggufs_exact_values(fmt):
    raw, ref = quantized(fmt, 24, 96, seed=1)
    blocks = decode(fmt, raw, (24, 96))
    assert blocks.shape == (24, 96)
    assert torch.equal(blocks.dequantize(), ref)


def test_decode_rejects_wrong_sizes_and_formats():
    raw, _ = quantized("Q4_1", 4, 64, seed=2)
    with pytest.raises(ValueError, match="needs 160 bytes"):
        decode("Q4_1", raw[:, :-1], (4, 64))
    with pytest.raises(ValueError, match="not a multiple of the block size"):
        decode("Q4_1", raw, (8, 20))
    with pytest.raises(ValueError, match="Q6_K is not a block format"):
        decode("Q6_K", raw, (4, 64))


def test_row_permutation_and_concatenation_act_on_whole_rows():
    raw_a, ref_a = quantized("Q4_1", 8, 64, seed=3)
    raw_b, ref_b = quantized("Q4_1", 4, 64, seed=4)
    a, b = decode("Q4_1", raw_a, (8, 64)), decode("Q4_1", raw_b, (4, 64))
    order = np.random.default_rng(5).permutation(8)
    assert torch.equal(a.rows(order).dequantize(), ref_a[torch.from_numpy(order)])
    assert torch.equal(BlockTensor.cat([a, b]).dequantize(), torch.cat([ref_a, ref_b]))
    q8 = decode("Q8_0", *quantized("Q8_0", 4, 64, seed=6)[:1], (4, 64))
    with pytest.raises(ValueError, match="different formats"):
        BlockTensor.cat([a, q8])


@needs_kernels
@pytest.mark.parametrize("fmt,cols,expected", [("Q4_0", 128, Int4GroupLinear), ("Q4_1", 96, Int4GroupLinear),
                                               ("Q8_0", 128, Int8BlockLinear),
                                               ("Q8_0", 32 * 80, Int8RowLinear)])
@pytest.mark.parametrize("tokens", [1, 5])
def test_quantized_linear_matches_float_reference(fmt, cols, expected, tokens, torch_kernels):
    rows = 48
    raw, weight = quantized(fmt, rows, cols, seed=7 + tokens)
    method = make_quantized_linear(decode(fmt, raw, (rows, cols)), torch.device("cpu"))
    assert isinstance(method, expected)
    x = torch.randn(tokens, cols)
    out = method(x)
    assert out.dtype == torch.float32 and out.shape == (tokens, rows)
    # bf16 activations (and bf16 scales; Int8RowLinear also requantizes each row)
    limit = 2e-2 if expected is Int8RowLinear else 1e-2
    assert rel_err(out, x @ weight.T) < limit
    # and a quantized weight is far smaller than the float one
    assert method.weight_bytes() < weight.numel() * 4 / 3


@needs_native
@pytest.mark.parametrize("fmt,cols", [("Q4_0", 128), ("Q4_1", 96), ("Q4_1", 1536), ("Q8_0", 576)])
def test_native_linear_matches_float_reference_and_is_batch_invariant(fmt, cols):
    rows = 40  # not a multiple of 16: the native kernels take any row count
    raw, weight = quantized(fmt, rows, cols, seed=21)
    method = make_quantized_linear(decode(fmt, raw, (rows, cols)), torch.device("cpu"))
    assert isinstance(method, NativeBlockLinear)
    x = torch.randn(6, cols)
    out = method(x)
    assert out.dtype == torch.float32 and out.shape == (6, rows)
    # activations as two int8 levels a block of 32 (~15 bits): 2e-5 measured, bf16's is 3e-3
    assert rel_err(out, x @ weight.T) < 2e-4
    # each token's row is the same whatever batch it is in
    assert torch.equal(method(x[2:3]), out[2:3])
    half = method(x.to(torch.bfloat16))  # a bf16 model: computed in fp32, returned in bf16
    assert half.dtype == torch.bfloat16 and rel_err(half, x.to(torch.bfloat16).float() @ weight.T) < 1e-2
    assert method.weight_bytes() < weight.numel() * 4 / 3


def test_native_kernels_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("ROOFLM_NATIVE_KERNELS", "0")
    native.library.cache_clear()
    try:
        assert native.library() is None
    finally:
        native.library.cache_clear()


def test_no_kernel_on_other_devices_means_dequantize():
    raw, _ = quantized("Q4_1", 8, 64, seed=9)
    assert make_quantized_linear(decode("Q4_1", raw, (8, 64)), torch.device("meta")) is None


@needs_kernels
def test_linear_keeps_blocks_and_fused_linear_fuses_shards(torch_kernels):
    raw_q, w_q = quantized("Q4_1", 16, 64, seed=10)
    raw_k, w_k = quantized("Q4_1", 16, 64, seed=11)
    fused = FusedLinear(64, {"q": 16, "k": 16})
    fused.load_shard("k", "weight", decode("Q4_1", raw_k, (16, 64)))  # any order
    fused.load_shard("q", "weight", decode("Q4_1", raw_q, (16, 64)))
    fused.finish_loading()
    assert fused.quant is not None and fused.weight.numel() == 0
    x = torch.randn(3, 64)
    assert rel_err(fused(x), x @ torch.cat([w_q, w_k]).T) < 1e-2

    single = Linear(64, 8)
    with pytest.raises(ValueError, match="shape mismatch"):
        single.load_blocks(decode("Q4_1", raw_k, (16, 64)))
    # 8 output rows: not a whole int4 tile, so the weight is dequantized instead
    raw_v, w_v = quantized("Q4_1", 8, 64, seed=14)
    single.load_blocks(decode("Q4_1", raw_v, (8, 64)))
    assert single.quant is None and torch.equal(single.weight.detach(), w_v)


@needs_kernels
def test_fused_linear_with_mixed_formats_falls_back_to_float():
    raw_q, w_q = quantized("Q4_1", 16, 64, seed=12)
    raw_k, w_k = quantized("Q8_0", 8, 64, seed=13)
    fused = FusedLinear(64, {"q": 16, "k": 8})
    fused.load_shard("q", "weight", decode("Q4_1", raw_q, (16, 64)))
    fused.load_shard("k", "weight", decode("Q8_0", raw_k, (8, 64)))
    fused.finish_loading()
    assert fused.quant is None
    assert torch.equal(fused.weight.detach(), torch.cat([w_q, w_k]))
