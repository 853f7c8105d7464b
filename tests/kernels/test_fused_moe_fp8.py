"""FP8 W8A8 experts in the fused MoE kernel (rooflm/kernels/fused_moe.py): E4M3 codes with
per-output-channel scales, activations quantized per token. Under the interpreter the fp8 dot
runs (FP8_DOT) and so does the fp16-upcast tile path; the GPU tests run both at model shapes."""

import pytest
import torch

from tests.kernels.helpers import DEVICE, cuda_capability_at_least, rel_error
from rooflm.kernels import fused_moe as fused_moe_module
from rooflm.kernels.fused_moe import (FusedMoeConfig, GemmTile, dequantize_fp8_experts, fused_moe,
                                      fused_moe_bytes, fused_moe_fp8_ref, fused_moe_ref)
from rooflm.quant.fp8 import quantize_fp8_experts

TINY = FusedMoeConfig(16, GemmTile(32, 32), GemmTile(32, 32))


def _layer(num_experts, hidden, inter, gen, bias=False):
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5
    b13 = torch.randn(num_experts, 2 * inter, generator=gen) if bias else None
    b2 = torch.randn(num_experts, hidden, generator=gen) if bias else None
    return w13, w2, b13, b2


def _routing(num_tokens, num_experts, top_k, gen, pool=None):
    ids = torch.stack([torch.randperm(pool or num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    return torch.rand(num_tokens, top_k, generator=gen) + 0.1, ids


def test_quantize_fp8_experts_per_output_channel():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 5, 16, generator=gen)
    w[1, 2] *= 100  # one loud channel must not coarsen the others
    codes, scales = quantize_fp8_experts(w)
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (3, 5)
    torch.testing.assert_close(scales, w.abs().amax(dim=2) / 448.0)
    back = dequantize_fp8_experts(codes, scales)
    assert ((back - w).abs() <= w.abs().amax(dim=2, keepdim=True) / 16).all()  # E4M3: 3 mantissa bits
    assert rel_error(back, w) < 0.04


def test_fp8_reference_tracks_the_float_experts():
    """The quantize/dequantize definition itself: W8A8's error against the float layer is the
    format's few percent, not a bug's order of magnitude."""
    gen = torch.Generator().manual_seed(1)
    w13, w2, _, _ = _layer(8, 64, 32, gen)
    x = torch.randn(6, 64, generator=gen)
    weights, ids = _routing(6, 8, 2, gen)
    c13, s13 = quantize_fp8_experts(w13)
    c2, s2 = quantize_fp8_experts(w2)
    err = rel_error(fused_moe_fp8_ref(x, c13, s13, c2, s2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids))
    assert 1e-4 < err < 0.08


@pytest.mark.parametrize("fp8_dot", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden,inter,pool,bias", [
    (1, 8, 2, 32, 32, None, False),    # decode
    (11, 8, 2, 48, 64, 3, False),      # crowded experts, five empty; H not a tile multiple
    (9, 8, 2, 32, 32, None, True),     # gpt-oss: biases and the clamped SwiGLU
])
def test_fp8_fused_moe_matches_its_definition(num_tokens, num_experts, top_k, hidden, inter, pool, bias, dtype,
                                              fp8_dot, monkeypatch):
    monkeypatch.setattr(fused_moe_module, "fp8_dot_supported", lambda device: fp8_dot)
    gen = torch.Generator().manual_seed(num_tokens + hidden)
    w13, w2, b13, b2 = _layer(num_experts, hidden, inter, gen, bias)
    x = (torch.randn(num_tokens, hidden, generator=gen) * (4 if bias else 1)).to(dtype)
    weights, ids = _routing(num_tokens, num_experts, top_k, gen, pool)
    c13, s13 = quantize_fp8_experts(w13)
    c2, s2 = quantize_fp8_experts(w2)
    kw = dict(activation="swigluoai", b13=b13.to(dtype), b2=b2.to(dtype)) if bias else {}
    on = lambda t: t.to(DEVICE)  # noqa: E731
    out = fused_moe(on(x), on(c13), on(c2), on(weights), on(ids), config=TINY,
                    w13_scale=on(s13), w2_scale=on(s2), **{k: on(v) if torch.is_tensor(v) else v for k, v in kw.items()})
    assert out.dtype == dtype and out.shape == x.shape
    ref = fused_moe_fp8_ref(x, c13, s13, c2, s2, weights, ids, **kw)
    # h's per-token fp8 rounding can flip a code where the sums' order moves h by an ulp
    assert rel_error(out.cpu(), ref) < (2e-3 if dtype == torch.float32 else 5e-3)


def test_fp8_experts_reject_mismatched_scales():
    gen = torch.Generator().manual_seed(2)
    w13, w2, _, _ = _layer(4, 32, 32, gen)
    c13, s13 = quantize_fp8_experts(w13)
    c2, s2 = quantize_fp8_experts(w2)
    x = torch.randn(2, 32)
    weights, ids = _routing(2, 4, 2, gen)
    with pytest.raises(ValueError, match="per output channel"):
        fused_moe(x, c13, c2, weights, ids, config=TINY, w13_scale=s13[:, :3], w2_scale=s2)
    with pytest.raises(TypeError, match="fp8 experts need"):
        fused_moe(x, w13, w2, weights, ids, config=TINY, w13_scale=s13, w2_scale=s2)


def test_fp8_bytes_count_one_byte_weights_and_their_scales():
    bf16 = fused_moe_bytes(1, 8, 8, 2048, 768, 2)
    fp8 = fused_moe_bytes(1, 8, 8, 2048, 768, 2, fp8=True)
    weights_bf16 = 8 * 3 * 2048 * 768 * 2
    assert fp8 < 0.52 * bf16 and fp8 > weights_bf16 / 2  # half the weights, plus scales and codes


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_capability_at_least((8, 9)), reason="fp8 tensor cores: sm89+")
@pytest.mark.parametrize("num_tokens", [1, 16, 64, 256])
@pytest.mark.parametrize("shape", [(128, 8, 2048, 768), (8, 2, 1024, 3584)])
def test_fp8_fused_moe_on_gpu_at_model_shapes(num_tokens, shape):
    num_experts, top_k, hidden, inter = shape
    gen = torch.Generator().manual_seed(num_tokens)
    w13, w2, _, _ = _layer(num_experts, hidden, inter, gen)
    x = torch.randn(num_tokens, hidden, generator=gen).to("cuda", torch.bfloat16)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    c13, s13 = quantize_fp8_experts(w13)
    c2, s2 = quantize_fp8_experts(w2)
    out = fused_moe(x, c13.cuda(), c2.cuda(), weights.cuda(), ids.cuda(), w13_scale=s13.cuda(), w2_scale=s2.cuda())
    ref = fused_moe_fp8_ref(x.cpu(), c13, s13, c2, s2, weights, ids)
    assert rel_error(out.float().cpu(), ref) < 2e-2
