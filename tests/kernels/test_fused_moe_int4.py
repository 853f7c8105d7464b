"""int4 (W4A16) experts in the fused MoE kernel, under TRITON_INTERPRET=1 in fp32 and fp16: the
packed codes' dequantized values through the fp32 definition, group sizes 16-64 with K / g odd
(the high half padded) and even, decode and crowded routing, gpt-oss's activation with biases."""

import pytest
import torch

from rooflm.kernels.fused_moe import FusedMoeConfig, GemmTile, dequantize_int4_experts, fused_moe, fused_moe_ref
from rooflm.kernels.int4_pack import pack_int4
from rooflm.quant.rtn import rtn_int4


def pack_int4_experts(w: torch.Tensor, group_size: int, dtype: torch.dtype):
    """Float experts [E, N, K] -> round to nearest int4: packed [E, N, S], scales / zeros [E, K/g, N]."""
    packed, scales, zeros = [], [], []
    for expert in w:
        q = rtn_int4(expert, group_size)
        packed.append(pack_int4(q.codes, group_size))
        scales.append(q.scales.to(dtype))
        zeros.append(q.zeros.to(dtype))
    return torch.stack(packed), torch.stack(scales), torch.stack(zeros)


def _case(e, h, i, group, tokens, top_k, dtype, seed=0, crowded=False, bias=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, h, generator=gen).to(dtype)
    w13 = torch.randn(e, 2 * i, h, generator=gen) * 0.2
    w2 = torch.randn(e, h, i, generator=gen) * 0.2
    q13, s13, z13 = pack_int4_experts(w13, group, dtype)
    q2, s2, z2 = pack_int4_experts(w2, group, dtype)
    logits = torch.randn(tokens, e, generator=gen)
    if crowded:  # most pairs on experts 0-2
        logits[:, :3] += 4.0
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    b13 = (torch.randn(e, 2 * i, generator=gen) * 0.1).to(dtype) if bias else None
    b2 = (torch.randn(e, h, generator=gen) * 0.1).to(dtype) if bias else None
    return x, (q13, s13, z13), (q2, s2, z2), weights, ids, b13, b2


@pytest.mark.parametrize("e,h,i,group,tokens,top_k,dtype,crowded", [
    (4, 64, 32, 32, 1, 2, torch.float32, False),     # decode; K / g even for H, one group for I (odd)
    (6, 96, 64, 32, 9, 2, torch.float32, True),      # H / g = 3: the high half past K is padding
    (4, 64, 48, 16, 5, 1, torch.float16, False),     # I / g = 3, fp16
    (8, 128, 64, 64, 12, 2, torch.float16, True),
])
def test_int4_experts_match_the_dequantized_definition(e, h, i, group, tokens, top_k, dtype, crowded):
    x, (q13, s13, z13), (q2, s2, z2), weights, ids, _, _ = _case(e, h, i, group, tokens, top_k, dtype,
                                                                 crowded=crowded)
    w13 = dequantize_int4_experts(q13, s13, z13, group, h)
    w2 = dequantize_int4_experts(q2, s2, z2, group, i)
    # BLOCK_K 128 is cut to the group inside; BLOCK_N 16 and 32 cover several column blocks
    cfg = FusedMoeConfig(16, GemmTile(16, 128), GemmTile(32, 64))
    out = fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2, w13_zeros=z13, w2_zeros=z2,
                    group_size=group, config=cfg)
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), ref, **tol)


def test_int4_experts_with_gpt_oss_activation_and_biases():
    x, (q13, s13, z13), (q2, s2, z2), weights, ids, b13, b2 = _case(4, 64, 32, 32, 6, 2, torch.float32, bias=True)
    out = fused_moe(x, q13, q2, weights, ids, b13=b13, b2=b2, activation="swigluoai", limit=1.5,
                    w13_scale=s13, w2_scale=s2, w13_zeros=z13, w2_zeros=z2, group_size=32,
                    config=FusedMoeConfig(16, GemmTile(32, 32), GemmTile(32, 32)))
    ref = fused_moe_ref(x, dequantize_int4_experts(q13, s13, z13, 32, 64), dequantize_int4_experts(q2, s2, z2, 32, 32),
                        weights, ids, b13=b13, b2=b2, activation="swigluoai", limit=1.5)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_int4_experts_refuse_bad_layouts():
    x, (q13, s13, z13), (q2, s2, z2), weights, ids, _, _ = _case(4, 64, 32, 32, 2, 2, torch.float32)
    with pytest.raises(ValueError, match="group size"):
        fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2, w13_zeros=z13, w2_zeros=z2, group_size=24)
    with pytest.raises(ValueError, match="w2_zeros"):
        fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2, w13_zeros=z13, w2_zeros=None, group_size=32)


@pytest.mark.gpu
@pytest.mark.parametrize("e,top_k,h,i,group", [(128, 8, 2048, 768, 128), (8, 2, 4096, 1792, 64)])
@pytest.mark.parametrize("tokens", [1, 16, 256])
def test_int4_experts_bf16_on_the_gpu(e, top_k, h, i, group, tokens):
    """bf16 x at Qwen3-30B-A3B's layer shape (g 128) and a Mixtral-like one (I cut to 1792, g 64),
    decode to prefill sizes, with the default tiles: within bf16 rounding of the fp32 definition."""
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, h, generator=gen).to(torch.bfloat16)
    w13 = torch.randn(e, 2 * i, h, generator=gen) * 0.02
    w2 = torch.randn(e, h, i, generator=gen) * 0.02
    q13, s13, z13 = pack_int4_experts(w13, group, torch.bfloat16)
    q2, s2, z2 = pack_int4_experts(w2, group, torch.bfloat16)
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, e, generator=gen), -1), top_k, dim=-1)
    ref = fused_moe_ref(x, dequantize_int4_experts(q13, s13, z13, group, h),
                        dequantize_int4_experts(q2, s2, z2, group, i), weights, ids)
    cuda = [t.cuda() for t in (x, q13, q2, weights, ids, s13, s2, z13, z2)]
    x, q13, q2, weights, ids, s13, s2, z13, z2 = cuda
    out = fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2, w13_zeros=z13, w2_zeros=z2,
                    group_size=group)
    scale = ref.abs().max().item()
    torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2 * scale)
