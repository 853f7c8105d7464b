"""FP8 (E4M3) KV cache with per-(token, head) or static per-head scales: the format
(layers/kv_cache.py), the writer (rope_kv_write) and both attention kernels against the paged
reference reading the same bytes."""

import pytest
import torch

from tests.kernels.helpers import DEVICE, assert_close, cuda_capability_at_least, random_paged_batch
import rooflm.envs as envs
from rooflm.kernels.decode_attention import decode_attention, decode_attention_ref
from rooflm.kernels.prefill_attention import prefill_attention, prefill_attention_ref
from rooflm.kernels.rope_kv_write import rope_kv_write, rope_kv_write_ref, write_kv
from rooflm.kernels.fp8_quant import FP8_DTYPE, FP8_MAX
from rooflm.kernels.paged_attention_ref import dequantize_ref, quantize_fp8_ref, quantize_fp8_static_ref
from rooflm.layers.rotary import build_cos_sin_cache


def fp8_batch(seq_lens, query_lens, num_kv_heads, head_dim, block_size):
    """A random paged batch whose cache is stored FP8 with per-(token, head) scales; the
    unused slots stay NaN (their scales too), so reading past a sequence fails the test."""
    meta, k, v = random_paged_batch(seq_lens, query_lens, num_kv_heads, head_dim, block_size,
                                    torch.float32, DEVICE)
    k8, ks = quantize_fp8_ref(k * 3.0)  # keys of a few units, like a rotated Llama key
    v8, vs = quantize_fp8_ref(v)
    return meta, k8, v8, ks.contiguous(), vs.contiguous()


def fp8_static_batch(seq_lens, query_lens, num_kv_heads, head_dim, block_size):
    """The same batch stored with one static scale per KV head (a calibrated checkpoint's), the
    heads of different magnitudes; unused slots stay NaN."""
    meta, k, v = random_paged_batch(seq_lens, query_lens, num_kv_heads, head_dim, block_size,
                                    torch.float32, DEVICE)
    magnitude = torch.logspace(-1, 1, num_kv_heads, device=DEVICE)[:, None]
    k, v = k * 3.0 * magnitude, v * magnitude
    ks = (k.nan_to_num().abs().amax((0, 1, 3)) / FP8_MAX).contiguous()
    vs = (v.nan_to_num().abs().amax((0, 1, 3)) / FP8_MAX).contiguous()
    return meta, quantize_fp8_static_ref(k, ks), quantize_fp8_static_ref(v, vs), ks, vs


def test_quantize_round_trip_error_is_within_e4m3_precision():
    x = torch.randn(64, 4, 128) * torch.logspace(-3, 2, 64)[:, None, None]  # magnitudes over 5 decades
    values, scale = quantize_fp8_ref(x)
    assert values.dtype == FP8_DTYPE and scale.shape == (64, 4)
    assert values.float().abs().amax(-1).sub(FP8_MAX).abs().max() == 0  # each row uses the whole range
    err = (dequantize_ref(values, scale) - x).abs() / x.abs().amax(-1, keepdim=True)
    assert err.max() < 2 ** -4  # 3 mantissa bits: half an ulp at the top is 1/16 of amax
    zeros, zscale = quantize_fp8_ref(torch.zeros(2, 3, 8))
    assert torch.isfinite(zscale).all() and (zscale > 0).all() and zeros.float().abs().sum() == 0


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("seq_lens,num_kv_heads,group,head_dim,block_size,num_splits", [
    ([1, 17, 97], 2, 4, 64, 16, None),
    ([300], 1, 8, 128, 16, 4),   # one sequence in splits (static: V's scale on every partial)
    ([45, 12], 2, 7, 64, 32, 1),
])
def test_decode_fp8_matches_reference(seq_lens, num_kv_heads, group, head_dim, block_size, num_splits, static):
    torch.manual_seed(0)
    batch = fp8_static_batch if static else fp8_batch
    meta, k8, v8, ks, vs = batch(seq_lens, [1] * len(seq_lens), num_kv_heads, head_dim, block_size)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, device=DEVICE).to(torch.float16)
    out = torch.full_like(q, float("nan"))
    scale = head_dim ** -0.5
    decode_attention(q, k8, v8, meta, scale, out=out, num_splits=num_splits, k_scale=ks, v_scale=vs)
    ref = decode_attention_ref(q, k8, v8, meta, scale, k_scale=ks, v_scale=vs)
    assert_close(out, ref, torch.float16, "decode fp8")
    # The scales are applied: the same bytes read as if every scale were 1 give another answer.
    ones = torch.ones_like(ks)
    assert (decode_attention_ref(q, k8, v8, meta, scale, k_scale=ones, v_scale=ones) - ref).abs().max() > 0.1


@pytest.mark.parametrize("seq_lens,query_lens,num_kv_heads,group,head_dim,block_size,window", [
    ([17], [17], 2, 4, 64, 16, None),
    ([1, 1, 250, 61], [1, 1, 250, 20], 2, 1, 128, 32, 64),  # decodes, a prefill, a chunk; window
    ([200], [37], 1, 4, 64, 16, None),                      # chunk after a cached prefix
])
def test_prefill_fp8_matches_reference(seq_lens, query_lens, num_kv_heads, group, head_dim, block_size, window):
    torch.manual_seed(1)
    meta, k8, v8, ks, vs = fp8_batch(seq_lens, query_lens, num_kv_heads, head_dim, block_size)
    q = torch.randn(meta.query_start_loc_cpu[-1], num_kv_heads * group, head_dim, device=DEVICE).to(torch.float16)
    out = torch.full_like(q, float("nan"))
    scale = head_dim ** -0.5
    first = meta.num_decodes
    prefill_attention(q, k8, v8, meta, scale, window, out=out, first_seq=first, k_scale=ks, v_scale=vs)
    ref = prefill_attention_ref(q, k8, v8, meta, scale, window, k_scale=ks, v_scale=vs)
    rows = meta.query_start_loc_cpu[first]
    assert_close(out[rows:], ref[rows:], torch.float16, "prefill fp8")


@pytest.mark.parametrize("seq_lens,query_lens,window", [
    ([17], [17], None),
    ([1, 1, 250, 61], [1, 1, 250, 20], 64),  # decodes, a prefill, a chunk; window
])
def test_prefill_fp8_static_scales_match_reference(seq_lens, query_lens, window):
    torch.manual_seed(4)
    meta, k8, v8, ks, vs = fp8_static_batch(seq_lens, query_lens, 2, 64, 16)
    q = torch.randn(meta.query_start_loc_cpu[-1], 8, 64, device=DEVICE).to(torch.float16)
    out = torch.full_like(q, float("nan"))
    first = meta.num_decodes
    prefill_attention(q, k8, v8, meta, 0.125, window, out=out, first_seq=first, k_scale=ks, v_scale=vs)
    ref = prefill_attention_ref(q, k8, v8, meta, 0.125, window, k_scale=ks, v_scale=vs)
    rows = meta.query_start_loc_cpu[first]
    assert_close(out[rows:], ref[rows:], torch.float16, "prefill fp8 static")


def rope_write_inputs():
    """7 tokens (one padding slot) of 8 query and 2 KV heads of 64, keys of a few units, for a
    cache of 4 blocks of 16: (q, k, v, positions, cos_sin table, slots)."""
    t, h, h_kv, d = 7, 8, 2, 64
    table = build_cos_sin_cache(d, 4096, 10000.0, None).to(DEVICE)
    positions = torch.randint(0, 4000, (t,), device=DEVICE)
    q = torch.randn(t, h, d, device=DEVICE)
    k = torch.randn(t, h_kv, d, device=DEVICE) * 5
    v = torch.randn(t, h_kv, d, device=DEVICE)
    slots = torch.tensor([3, 40, -1, 17, 0, 63, 21], device=DEVICE)
    return q, k, v, positions, table, slots


def test_rope_kv_write_fp8_static_scales_saturate_like_the_reference():
    torch.manual_seed(5)
    h_kv, d, bs = 2, 64, 16
    q, k, v, positions, table, slots = rope_write_inputs()
    # Head 0's scales are too small for its values: they saturate at +-448 instead of overflowing.
    ks = torch.tensor([0.005, 0.05], device=DEVICE)
    vs = torch.tensor([0.001, 0.01], device=DEVICE)
    shape = (4, bs, h_kv, d)
    kc, vc, kc_ref, vc_ref = (torch.zeros(shape, dtype=FP8_DTYPE, device=DEVICE) for _ in range(4))
    q_out = rope_kv_write(q.clone(), k, v, positions, table, kc, vc, slots, k_scale=ks, v_scale=vs)
    q_ref = rope_kv_write_ref(q.clone(), k, v, positions, table, kc_ref, vc_ref, slots, k_scale=ks, v_scale=vs)
    assert_close(q_out, q_ref, torch.float32, "rotated q")
    for got, want in ((kc, kc_ref), (vc, vc_ref)):
        assert torch.isfinite(got.float()).all()
        assert (got.view(torch.uint8) != want.view(torch.uint8)).float().mean() < 0.01  # rounding ties only
    assert kc[..., 0, :].float().abs().max() == FP8_MAX  # saturated
    flat_v = dequantize_ref(vc, vs).view(-1, h_kv, d)
    rel = (flat_v[40, 1] - v[1, 1]).abs().max() / v[1, 1].abs().max()
    assert rel < 2 ** -4


def test_static_scales_of_the_wrong_shape_are_refused():
    meta, k8, v8, ks, vs = fp8_static_batch([5], [1], 2, 64, 16)
    q = torch.randn(1, 4, 64, device=DEVICE).to(torch.float16)
    with pytest.raises(ValueError, match=r"\(2,\) \(static\)"):
        decode_attention(q, k8, v8, meta, 0.125, k_scale=ks[:1], v_scale=vs[:1])


def _empty_fp8_cache(num_blocks, block_size, num_kv_heads, head_dim):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    cache = [torch.zeros(shape, dtype=FP8_DTYPE, device=DEVICE) for _ in range(2)]
    scales = [torch.zeros(shape[:3], dtype=torch.float32, device=DEVICE) for _ in range(2)]
    return cache, scales


@pytest.mark.parametrize("is_neox,rotary_dim", [(True, None), (False, None), (True, 32)])
def test_rope_kv_write_fp8_matches_reference(is_neox, rotary_dim):
    """rotary_dim 32 of 64: a partial rotary, whose unrotated tail joins the head's scale."""
    torch.manual_seed(2)
    h_kv, d, bs = 2, 64, 16
    q, k, v, positions, table, slots = rope_write_inputs()
    if rotary_dim is not None:  # the first rotary_dim / 2 frequencies' cos | sin
        half = table.shape[1] // 2
        table = torch.cat([table[:, :rotary_dim // 2], table[:, half:half + rotary_dim // 2]], dim=1).contiguous()
        k = k.clone()
        k[..., rotary_dim:] *= 8  # the tail sets the scale: it must be counted
    (kc, vc), (ks, vs) = _empty_fp8_cache(4, bs, h_kv, d)
    (kc_ref, vc_ref), (ks_ref, vs_ref) = _empty_fp8_cache(4, bs, h_kv, d)
    q_out = rope_kv_write(q.clone(), k, v, positions, table, kc, vc, slots, is_neox,
                          k_scale=ks, v_scale=vs)
    q_ref = rope_kv_write_ref(q.clone(), k, v, positions, table, kc_ref, vc_ref, slots, is_neox,
                              k_scale=ks_ref, v_scale=vs_ref)
    assert_close(q_out, q_ref, torch.float32, "rotated q")
    torch.testing.assert_close(ks, ks_ref, rtol=1e-5, atol=0)
    torch.testing.assert_close(vs, vs_ref, rtol=1e-5, atol=0)
    # The same E4M3 codes, but for a rounding tie the fp32 rotation may break either way.
    for got, want, s in ((kc, kc_ref, ks), (vc, vc_ref, vs)):
        diff = (dequantize_ref(got, s) - dequantize_ref(want, s)).abs()
        assert diff.max() <= (s[..., None] * 32).max()  # at most one E4M3 step at the top of the range
        assert (got.view(torch.uint8) != want.view(torch.uint8)).float().mean() < 0.01


def test_write_kv_fp8_skips_padding_and_keeps_scales_per_head():
    t, h_kv, d, bs = 4, 2, 32, 8
    k = torch.randn(t, h_kv, d, device=DEVICE)
    k[:, 1] *= 100  # heads of very different magnitude get their own scales
    v = torch.randn(t, h_kv, d, device=DEVICE)
    slots = torch.tensor([0, -1, 9, 15], device=DEVICE)
    (kc, vc), (ks, vs) = _empty_fp8_cache(2, bs, h_kv, d)
    write_kv(k, v, kc, vc, slots, ks, vs)
    flat_k = dequantize_ref(kc, ks).view(-1, h_kv, d)
    for tok, slot in ((0, 0), (2, 9), (3, 15)):
        rel = (flat_k[slot] - k[tok]).abs().amax(-1) / k[tok].abs().amax(-1)
        assert (rel < 2 ** -4).all()
    written = torch.zeros(2 * bs, dtype=torch.bool)
    written[[0, 9, 15]] = True
    assert ks.view(-1, h_kv)[~written].eq(0).all()  # the padding token wrote nothing
    assert ks.view(-1, h_kv)[9, 1] > 50 * ks.view(-1, h_kv)[9, 0]


def test_fp8_cache_without_scales_is_refused():
    meta, k8, v8, ks, vs = fp8_batch([5], [1], 1, 64, 16)
    q = torch.randn(1, 4, 64, device=DEVICE).to(torch.float16)
    with pytest.raises(ValueError, match="k_scale"):
        decode_attention(q, k8, v8, meta, 0.125)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_capability_at_least((8, 9)), reason="the byte-pair widening needs sm_89+")
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_fp8_byte_pairs_match_bytewise_loads(kind):
    """The Llama-3-8B shape through the byte-pair loads (utils.load_e4m3_pairs, what the engine
    runs on Hopper) and through bytewise loads (ROOFLM_FP8_PAIRS=0): both against the reference."""
    import rooflm.kernels.utils as kernel_utils

    torch.manual_seed(2)
    lens = [330, 17, 1025, 64]
    meta, k8, v8, ks, vs = fp8_batch(lens, [1] * len(lens) if kind == "decode" else lens, 8, 128, 16)
    assert kernel_utils.fp8_pair_views(k8, v8) is not None
    q = torch.randn(meta.query_start_loc_cpu[-1], 32, 128, device=DEVICE).to(torch.bfloat16)
    run = decode_attention if kind == "decode" else prefill_attention
    outs = []
    for pairs in (True, False):
        with envs.override("ROOFLM_FP8_PAIRS", "1" if pairs else "0"):
            outs.append(run(q, k8, v8, meta, 128 ** -0.5, k_scale=ks, v_scale=vs))
    ref = (decode_attention_ref if kind == "decode" else prefill_attention_ref)(q, k8, v8, meta, 128 ** -0.5,
                                                                               k_scale=ks, v_scale=vs)
    for out in outs:
        assert_close(out, ref, torch.bfloat16, f"{kind} fp8")
