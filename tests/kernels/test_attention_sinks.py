"""Attention sinks (gpt-oss: one logit per query head in each softmax's denominator) through the
Triton decode and prefill kernels and the Triton backend, against the torch reference; the
reference against the sink's definition; FA4 refusing sinks (the Triton prefill takes them).
Under TRITON_INTERPRET=1 on the CPU (fp16/fp32, small shapes); bf16 at real shapes with -m gpu."""

import logging

import pytest
import torch

from rooflm.kernels.decode_attention import decode_attention, decode_attention_ref
from rooflm.kernels.paged_attention_ref import gather_kv_ref, paged_attention_ref
from rooflm.kernels.prefill_attention import prefill_attention, prefill_attention_ref
from rooflm.layers.attention import ReferenceBackend
from rooflm.layers.cuda_attention import TritonBackend
from tests.kernels.helpers import DEVICE, assert_close, random_paged_batch


def sinks_for(num_heads: int, seed: int = 0) -> torch.Tensor:
    """Sink logits around the scores' scale, one far above them (the sink takes nearly all the
    weight: no overflow) and one far below (no weight)."""
    gen = torch.Generator().manual_seed(seed)
    sinks = 2.0 * torch.randn(num_heads, generator=gen)
    sinks[0], sinks[-1] = 30.0, -30.0
    return sinks.to(DEVICE)


def batch(seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    torch.manual_seed(seed)
    meta, k_cache, v_cache = random_paged_batch(seq_lens, query_lens, num_kv_heads, head_dim, block_size,
                                                dtype, DEVICE)
    q = (2 * torch.randn(meta.query_start_loc_cpu[-1], num_heads, head_dim, device=DEVICE)).to(dtype)
    return meta, q, k_cache, v_cache


def test_reference_sinks_follow_their_definition():
    """out = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink}): the plain attention times
    sigmoid(logsumexp(s) - sink), head by head (GQA, a window, a prefill chunk and a decode)."""
    heads, kv_heads, d, window = 4, 2, 16, 6
    meta, q, k_cache, v_cache = batch([9, 20], [1, 5], heads, kv_heads, d, 4, torch.float32)
    sinks = sinks_for(heads)
    scale = d ** -0.5
    out = paged_attention_ref(q, k_cache, v_cache, meta, scale, window, sinks=sinks)
    plain = paged_attention_ref(q, k_cache, v_cache, meta, scale, window)
    starts = meta.query_start_loc_cpu
    for s, seq_len in enumerate(meta.seq_lens_cpu):
        k = gather_kv_ref(k_cache, meta.block_tables[s], seq_len).repeat_interleave(heads // kv_heads, 1)
        for row in range(starts[s], starts[s + 1]):
            pos = seq_len - (starts[s + 1] - row)
            keys = k[max(0, pos + 1 - window):pos + 1]  # [n, H, D]
            lse = torch.logsumexp(torch.einsum("hd,nhd->hn", q[row].float(), keys) * scale, dim=-1)
            want = plain[row] * torch.sigmoid(lse - sinks)[:, None]
            torch.testing.assert_close(out[row], want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(out, plain, atol=1e-3)  # the sinks took weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 24])
def test_decode_kernel_with_sinks(dtype, num_splits, window):
    heads, kv_heads, d = 8, 2, 64
    meta, q, k_cache, v_cache = batch([40, 3, 77], [1, 1, 1], heads, kv_heads, d, 16, dtype)
    sinks = sinks_for(heads)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, k_cache, v_cache, meta, d ** -0.5, window, out=out, num_splits=num_splits, sinks=sinks)
    ref = decode_attention_ref(q, k_cache, v_cache, meta, d ** -0.5, window, sinks=sinks)
    assert_close(out, ref, dtype, f"decode splits={num_splits}")
    plain = decode_attention_ref(q, k_cache, v_cache, meta, d ** -0.5, window)
    assert not torch.allclose(ref.float(), plain.float(), atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 24])
def test_prefill_kernel_with_sinks(dtype, window):
    # a chunk over a cached prefix and a fresh prompt; GQA group 4
    heads, kv_heads, d = 8, 2, 64
    meta, q, k_cache, v_cache = batch([70, 30], [20, 30], heads, kv_heads, d, 16, dtype)
    sinks = sinks_for(heads, seed=1)
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, k_cache, v_cache, meta, d ** -0.5, window, out=out, sinks=sinks)
    ref = prefill_attention_ref(q, k_cache, v_cache, meta, d ** -0.5, window, sinks=sinks)
    assert_close(out, ref, dtype, "prefill")


def test_uniform_prefill_path_takes_sinks():
    """--deterministic's path (decodes through the uniform prefill kernel) with sinks."""
    heads, kv_heads, d = 4, 1, 32
    meta, q, k_cache, v_cache = batch([33, 5, 40], [1, 1, 12], heads, kv_heads, d, 16, torch.float16)
    sinks = sinks_for(heads, seed=2)
    triton = TritonBackend(deterministic=True)
    out = triton.attend(q, k_cache, v_cache, meta, d ** -0.5, 16, sinks=sinks)
    ref = ReferenceBackend().attend(q, k_cache, v_cache, meta, d ** -0.5, 16, sinks=sinks)
    assert_close(out, ref, torch.float16, "uniform path")


def test_backend_alternating_windows_with_sinks():
    """gpt-oss's layers through the Triton backend: windows alternating, each layer its own sinks,
    one plan per window reused layer after layer; every layer's output equals the reference's."""
    heads, kv_heads, d = 8, 2, 64
    meta, _, k_cache, v_cache = batch([40, 3, 120, 30], [1, 1, 16, 30], heads, kv_heads, d, 16, torch.float16)
    t = meta.query_start_loc_cpu[-1]
    triton, reference = TritonBackend(decode_num_splits=2), ReferenceBackend()
    for layer, window in enumerate((24, None, 24, None)):
        q = (2 * torch.randn(t, heads, d, device=DEVICE)).to(torch.float16)
        sinks = sinks_for(heads, seed=layer)
        out = triton.attend(q, k_cache, v_cache, meta, d ** -0.5, window, sinks=sinks)
        ref = reference.attend(q, k_cache, v_cache, meta, d ** -0.5, window, sinks=sinks)
        assert_close(out, ref, torch.float16, f"layer {layer} window {window}")
    assert sorted(meta.plan, key=str) == sorted({24, None}, key=str)


def test_fa4_refuses_sinks_for_the_triton_prefill(monkeypatch, caplog):
    """Where FA4 would take a step's prefill, a model with sinks gets the Triton prefill plan
    instead, and the INFO log says so once."""
    import rooflm.layers.cuda_attention as cuda_attention
    from rooflm.kernels.fa4_prefill import FA4Plan
    from rooflm.kernels.prefill_attention import PrefillPlan
    monkeypatch.setattr(cuda_attention, "fa4_supports", lambda *a: True)
    heads, kv_heads, d = 4, 2, 64
    meta, q, k_cache, v_cache = batch([20, 30], [1, 30], heads, kv_heads, d, 16, torch.float16)
    backend = TritonBackend(prefill_fa4=True)
    out = torch.empty_like(q)
    assert isinstance(backend.plan(q, k_cache, v_cache, meta, None, out)[1], FA4Plan)
    with caplog.at_level(logging.INFO, logger=cuda_attention.__name__):
        for _ in range(2):
            _, prefill = backend.plan(q, k_cache, v_cache, meta, None, out, sinks=sinks_for(heads))
            assert isinstance(prefill, PrefillPlan)
    assert sum("FA4 takes no attention sinks" in r.message for r in caplog.records) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1])
def test_sinks_gpu_bf16(num_splits):
    """gpt-oss's attention shape (64 heads, 8 KV heads, head_dim 64) in bf16: long decodes (split),
    a prefill chunk and a fresh prompt, windows of 128 and none."""
    heads, kv_heads, d = 64, 8, 64
    lens, qlens = [3000] * 4 + [17, 1000, 2048], [1] * 4 + [17, 512, 2048]
    meta, q, k_cache, v_cache = batch(lens, qlens, heads, kv_heads, d, 16, torch.bfloat16)
    sinks = sinks_for(heads).to(torch.bfloat16)
    for window in (128, None):
        out = TritonBackend(decode_num_splits=num_splits).attend(q, k_cache, v_cache, meta, d ** -0.5, window,
                                                                 sinks=sinks)
        ref = ReferenceBackend().attend(q, k_cache, v_cache, meta, d ** -0.5, window, sinks=sinks)
        assert_close(out, ref, torch.bfloat16, f"window {window}")
