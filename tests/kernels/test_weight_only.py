"""W4A16 and W8A16 weight-only kernels (rooflm/kernels/w4a16.py, w8a16.py) against dequantize-then-matmul."""

import pytest
import torch

from tests.kernels.conftest import DEVICE, assert_close, requires_cuda
from rooflm.kernels.w4a16 import pack_int4, unpack_int4, w4a16_linear, w4a16_linear_ref
from rooflm.kernels.w8a16 import w8a16_linear, w8a16_linear_ref


def _w4(n, k, group, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = (0.01 + 0.02 * torch.rand(k // group, n, generator=g)).to(dtype)
    zeros = torch.randint(0, 16, (k // group, n), generator=g).to(dtype)  # asymmetric
    return pack_int4(codes).to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), g


def test_int4_packing_round_trips_and_puts_even_k_low():
    codes = torch.randint(0, 16, (3, 8), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert torch.equal(unpack_int4(packed), codes)
    assert int(packed[0, 0]) == int(codes[0, 0]) | (int(codes[0, 1]) << 4)


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_w4a16_matches_reference(m, group):
    dtype = torch.float16
    n, k = 40, 256  # n not a multiple of the tile: the masks are exercised
    qw, s, z, g = _w4(n, k, group, dtype, seed=group + m)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    assert_close(w4a16_linear(x, qw, s, z, group), w4a16_linear_ref(x, qw, s, z, group), dtype, f"m={m} g={group}")


def test_w4a16_fp32_and_strided_input():
    qw, s, z, g = _w4(32, 128, 32, torch.float32)
    x = torch.randn(2, 256, generator=g).to(DEVICE)[:, ::2]  # non-contiguous rows
    assert_close(w4a16_linear(x, qw, s, z, 32), w4a16_linear_ref(x, qw, s, z, 32), torch.float32)


def test_w4a16_rejects_bad_shapes():
    qw, s, z, _ = _w4(16, 64, 32, torch.float16)
    with pytest.raises(ValueError, match="qweight"):
        w4a16_linear(torch.zeros(1, 32, dtype=torch.float16, device=DEVICE), qw, s, z, 32)
    with pytest.raises(ValueError, match="scales and zeros"):
        w4a16_linear(torch.zeros(1, 64, dtype=torch.float16, device=DEVICE), qw, s[:1], z, 32)


@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("with_zero", [False, True])
def test_w8a16_matches_reference(m, with_zero):
    dtype = torch.float16
    g = torch.Generator().manual_seed(m + 10 * with_zero)
    n, k = 24, 200  # K not a multiple of the tile
    qw = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8).to(DEVICE)
    s = (0.001 + 0.002 * torch.rand(n, generator=g)).to(dtype).to(DEVICE)
    z = torch.randint(-8, 8, (n,), generator=g).to(dtype).to(DEVICE) if with_zero else None
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    assert_close(w8a16_linear(x, qw, s, z), w8a16_linear_ref(x, qw, s, z), dtype, f"m={m} zero={with_zero}")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (4096, 14336)])
def test_weight_only_bf16_large(m, n, k):
    """The Llama-3-8B shapes in bf16, compiled (tl.dot on bf16 is wrong only in the interpreter)."""
    dtype = torch.bfloat16
    qw, s, z, g = _w4(n, k, 128, dtype, seed=m)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    assert_close(w4a16_linear(x, qw, s, z, 128), w4a16_linear_ref(x, qw, s, z, 128), dtype, "w4")
    q8 = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8).to(DEVICE)
    s8 = (0.001 * torch.rand(n, generator=g) + 1e-4).to(dtype).to(DEVICE)
    assert_close(w8a16_linear(x, q8, s8), w8a16_linear_ref(x, q8, s8), dtype, "w8")


@pytest.mark.parametrize("act_order", [False, True])
def test_linear_methods_match_dequantized_weights(act_order):
    """W4A16Linear / W8A16Linear (what a Linear holds on CUDA) against x @ W.T with W decoded from the
    GPTQ tensors: act-order's permutation of the inputs included."""
    from rooflm.quant import formats
    from rooflm.quant.gptq import gptq_quantize
    from rooflm.quant.linear_method import W4A16Linear, W8A16Linear
    from rooflm.quant.rtn import rtn_int8
    g = torch.Generator().manual_seed(7)
    n, k = 32, 128
    x_cal = torch.randn(64, k, generator=g) * torch.linspace(0.2, 2.0, k)
    w = torch.randn(n, k, generator=g)
    q = gptq_quantize(w, x_cal.T @ x_cal, 4, 32, act_order=act_order)
    t = formats.to_gptq(q, 4)
    loaded = formats.from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 4, 32)
    assert (loaded.perm is not None) == act_order
    x = torch.randn(3, k, generator=g).to(torch.float16)
    for m in (1, 3):
        out = W4A16Linear(loaded, torch.device(DEVICE), torch.float16)(x[:m].to(DEVICE))
        ref = (x[:m].float() @ loaded.dequantize().T).to(torch.float16)
        assert_close(out.cpu(), ref, torch.float16, f"w4 m={m}")
    q8 = rtn_int8(w)
    out = W8A16Linear(q8, torch.device(DEVICE), torch.float16)(x.to(DEVICE))
    assert_close(out.cpu(), (x.float() @ q8.dequantize().T).to(torch.float16), torch.float16, "w8")
