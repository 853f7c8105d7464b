"""GGUF blocks in the CUDA kernels' form (formats.from_gguf_blocks -> W4A16 / W8A16 group-wise):
the same values gguf-py decodes, and the linears (under Triton's interpreter on the CPU) against
x @ W.T with W from gguf-py."""

import numpy as np
import pytest
import torch

from tests.kernels.helpers import DEVICE, assert_close
from tests.unit.gguf_q4k import encode_q4_k
from rooflm.quant.formats import from_gguf_blocks
from rooflm.quant.gguf_blocks import decode
from rooflm.quant.linear_method import W4A16Linear, W8A16Linear, make_linear_method

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

FORMATS = ["Q4_0", "Q4_1", "Q8_0", "Q4_K"]


def gguf_weight(fmt, rows, cols, seed):
    """(raw bytes, gguf-py's dequantization [rows, cols]) of random weights; Q4_K through the test
    encoder (gguf-py cannot quantize it), decoded by gguf-py all the same."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    qtype = GGMLQuantizationType[fmt]
    raw = encode_q4_k(w) if fmt == "Q4_K" else gguf_quants.quantize(w, qtype)
    return raw, torch.from_numpy(gguf_quants.dequantize(raw, qtype)).reshape(rows, cols)


@pytest.mark.parametrize("fmt", FORMATS)
def test_group_weight_holds_ggufs_values(fmt):
    raw, ref = gguf_weight(fmt, 24, 512, seed=3)
    gw = from_gguf_blocks(decode(fmt, raw, (24, 512)))
    assert gw.group_size == 32 and gw.keep_dtype and gw.bits == (8 if fmt == "Q8_0" else 4)
    assert gw.scales.shape == gw.zeros.shape == (16, 24)
    w = gw.dequantize()
    if fmt in ("Q4_0", "Q8_0"):
        # d from the file in fp16, zero 8 (or 0): (q - 8) d is exact
        assert gw.scales.dtype == torch.float16 and torch.equal(w, ref)
        assert torch.all(gw.zeros == (0 if fmt == "Q8_0" else 8))
    else:
        # zero = -offset / scale in fp32 is the one rounding: a few fp32 ulps of the weights
        assert gw.zeros.dtype == torch.float32
        assert gw.scales.dtype == (torch.float16 if fmt == "Q4_1" else torch.float32)
        assert (w - ref).abs().max() <= 4e-7 * ref.abs().max()


def test_constant_blocks_with_scale_zero_keep_their_value():
    """A Q4_1 block with d = 0 is the constant m whatever its codes: the kernel form rewrites it."""
    raw, _ = gguf_weight("Q4_1", 4, 64, seed=5)
    blocks = raw.reshape(4, 2, 20).copy()
    blocks[1, 0, 0:2] = np.frombuffer(np.float16(0.0).tobytes(), np.uint8)
    blocks[1, 0, 2:4] = np.frombuffer(np.float16(-0.0312).tobytes(), np.uint8)
    blocks[2, 1, 0:4] = 0  # d = 0 and m = 0: zeros
    ref = torch.from_numpy(gguf_quants.dequantize(blocks, GGMLQuantizationType.Q4_1)).reshape(4, 64)
    assert torch.all(ref[1, :32] == np.float32(np.float16(-0.0312)))
    gw = from_gguf_blocks(decode("Q4_1", blocks, (4, 64)))
    w = gw.dequantize()
    assert torch.equal(w[1, :32], ref[1, :32]) and torch.equal(w[2, 32:], ref[2, 32:])
    assert (w - ref).abs().max() <= 4e-7 * ref.abs().max()  # the other blocks: -m / d's rounding


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 5])
def test_linears_match_ggufs_weights(fmt, m):
    """W4A16Linear / W8A16Linear (what a Linear holds on CUDA) on the blocks against x @ W.T."""
    n, k = 40, 512
    raw, ref = gguf_weight(fmt, n, k, seed=11 + m)
    gw = from_gguf_blocks(decode(fmt, raw, (n, k)))
    cls = W8A16Linear if fmt == "Q8_0" else W4A16Linear
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g)
    for dtype in (torch.float32, torch.float16):
        method = cls(gw, torch.device(DEVICE), dtype)
        # scales and zeros on the device as decoded (fp16/fp32), not in the activation dtype
        assert method.scales.dtype == gw.scales.dtype
        out = method(x.to(dtype).to(DEVICE)).cpu()
        assert out.dtype == dtype and out.shape == (m, n)
        assert_close(out, (x.to(dtype).float() @ ref.T).to(dtype), dtype, f"{fmt} {dtype}")
    # 4-bit: codes packed two a byte; 8-bit: one; plus the (group, row) scales and zeros
    assert method.weight_bytes() < n * k * (1.2 if fmt == "Q8_0" else 0.8)


def test_activation_dtype_rounding_of_scales_and_zeros_is_what_keep_dtype_avoids():
    """What rounding Q4_1/Q4_K scales and zeros to bf16 would cost (docs/quantization.md's figure): relative
    weight error well above the fp32 rounding kept here."""
    for fmt in ("Q4_1", "Q4_K"):
        raw, ref = gguf_weight(fmt, 64, 1024, seed=17)
        gw = from_gguf_blocks(decode(fmt, raw, (64, 1024)))
        rounded = type(gw)(gw.codes, gw.scales.to(torch.bfloat16), gw.zeros.to(torch.bfloat16), 32,
                           bits=4).dequantize()
        err = ((rounded - ref).norm() / ref.norm()).item()
        exact = ((gw.dequantize() - ref).norm() / ref.norm()).item()
        assert exact < 1e-6 < 1e-3 < err < 2e-2, (fmt, exact, err)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_make_linear_method_routes_gguf_to_triton_on_cuda(fmt):
    n, k = 4096, 4096
    raw, ref = gguf_weight(fmt, n, k, seed=23)
    method = make_linear_method(decode(fmt, raw, (n, k)), torch.device("cuda"), torch.bfloat16)
    assert isinstance(method, W8A16Linear if fmt == "Q8_0" else W4A16Linear)
    for m in (1, 16, 64):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        assert_close(method(x), (x.float() @ ref.cuda().T).to(torch.bfloat16), torch.bfloat16, f"{fmt} m={m}")
