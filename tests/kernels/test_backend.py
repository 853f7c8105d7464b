"""TritonBackend (rooflm/layers/cuda_attention.py) against ReferenceBackend, call for call."""

import pytest
import torch

from tests.kernels.helpers import DEVICE, assert_close, random_paged_batch
from rooflm.layers.cuda_attention import TritonBackend
from rooflm.layers.attention import AttentionBackend, ReferenceBackend


def run_step(seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, window,
             num_splits=None):
    """One engine step as the attention layer drives it: write this step's K/V, then attend."""
    meta, k_cache, v_cache = random_paged_batch(seq_lens, query_lens, num_kv_heads, head_dim, block_size,
                                                dtype, DEVICE)
    t = meta.query_start_loc_cpu[-1]
    q = torch.randn(t, num_heads, head_dim, device=DEVICE).to(dtype)
    k = torch.randn(t, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    v = torch.randn(t, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    results = []
    for backend in (TritonBackend(decode_num_splits=num_splits), ReferenceBackend()):
        caches = (k_cache.clone(), v_cache.clone())
        backend.write_kv(k, v, *caches, meta.slot_mapping)
        out = backend.attend(q, *caches, meta, head_dim ** -0.5, window)
        results.append((out, caches))
    (out, (kc, vc)), (ref, (kc_ref, vc_ref)) = results
    assert_close(out, ref, dtype, "attention output")
    # The step's K/V went into the same slots (the NaN poison of unused slots stays put).
    assert torch.equal(kc.nan_to_num(7.0), kc_ref.nan_to_num(7.0))
    assert torch.equal(vc.nan_to_num(7.0), vc_ref.nan_to_num(7.0))


@pytest.mark.parametrize("window", [None, 24])
def test_backend_mixed_step(window):
    # 2 decodes, a chunk of a long prompt (prefix cached), a fresh prompt.
    run_step([40, 3, 120, 30], [1, 1, 16, 30], 8, 2, 64, 16, torch.float16, window)


def test_backend_all_decodes_fp32():
    run_step([5, 70, 33], [1, 1, 1], 4, 1, 128, 32, torch.float32, None, num_splits=3)


def test_backend_all_prefill():
    run_step([23, 9], [23, 9], 4, 4, 80, 16, torch.float16, None)


@pytest.mark.skipif(not hasattr(AttentionBackend, "rope_and_write"), reason="layer without rope_and_write")
def test_backend_rope_and_write_matches_reference():
    from rooflm.layers.rotary import RotaryEmbedding

    rotary = RotaryEmbedding(64, 512, 10000.0, None).to(DEVICE)
    t, num_heads, num_kv_heads = 7, 4, 2
    qkv = torch.randn(t, (num_heads + 2 * num_kv_heads) * 64, device=DEVICE).to(torch.float16)
    q, k, v = (x.view(t, -1, 64) for x in qkv.split([num_heads * 64, num_kv_heads * 64, num_kv_heads * 64], -1))
    positions = torch.randint(0, 512, (t,), device=DEVICE)
    slot_mapping = torch.randperm(64, device=DEVICE)[:t]
    slot_mapping[2] = -1
    cache = torch.full((4, 16, num_kv_heads, 64), float("nan"), dtype=torch.float16, device=DEVICE)
    outs = []
    for backend in (TritonBackend(), ReferenceBackend()):
        caches = (cache.clone(), cache.clone())
        q_rot = backend.rope_and_write(q.clone(), k.clone(), v.clone(), positions, rotary, *caches, slot_mapping)
        outs.append((q_rot, caches))
    (q_rot, (kc, vc)), (q_ref, (kc_ref, vc_ref)) = outs
    written = slot_mapping[slot_mapping >= 0]
    assert_close(q_rot, q_ref, torch.float16, "q")
    assert_close(kc.view(-1, num_kv_heads, 64)[written], kc_ref.view(-1, num_kv_heads, 64)[written], torch.float16)
    assert torch.equal(vc.nan_to_num(7.0), vc_ref.nan_to_num(7.0))
    assert torch.isnan(kc).sum() == torch.isnan(kc_ref).sum()


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 256])
def test_backend_gpu_bf16(block_size):
    lens = [3000] * 4 + [17, 1000, 2048]
    qlens = [1] * 4 + [17, 512, 2048]
    run_step(lens, qlens, 32, 8, 128, block_size, torch.bfloat16, None)


def run_alternating_layers(seq_lens, query_lens, dtype, windows, softcap, block_size=16):
    """Layers of one step with their own windows (Gemma 2/3: sliding and global alternate) and
    soft-capped scores: the Triton backend plans once per window and reuses each plan, layer
    after layer, on the step's one metadata; every layer's output matches the reference."""
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    meta, k_cache, v_cache = random_paged_batch(seq_lens, query_lens, num_kv_heads, head_dim, block_size,
                                                dtype, DEVICE)
    t = meta.query_start_loc_cpu[-1]
    triton, reference = TritonBackend(), ReferenceBackend()
    for layer, window in enumerate(windows):
        # Scores well past the cap, so the cap changes the softmax (tanh saturates at 4x the cap).
        q = (4 * torch.randn(t, num_heads, head_dim, device=DEVICE)).to(dtype)
        out = triton.attend(q, k_cache, v_cache, meta, head_dim ** -0.5, window, softcap=softcap)
        ref = reference.attend(q, k_cache, v_cache, meta, head_dim ** -0.5, window, softcap=softcap)
        assert_close(out, ref, dtype, f"layer {layer} window {window}")
    assert sorted(meta.plan, key=str) == sorted(set(windows), key=str)  # one plan per window
    if softcap is not None:
        uncapped = reference.attend(q, k_cache, v_cache, meta, head_dim ** -0.5, windows[-1])
        assert not torch.allclose(uncapped.float(), ref.float(), atol=1e-2)  # the cap took effect


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_backend_alternating_windows_and_softcap(softcap):
    # 2 decodes, a chunk over a cached prefix, a fresh prompt; windows 24 / none / 24 / none
    run_alternating_layers([40, 3, 120, 30], [1, 1, 16, 30], torch.float16, (24, None, 24, None), softcap)


@pytest.mark.gpu
def test_backend_alternating_windows_and_softcap_gpu_bf16():
    lens = [3000] * 4 + [17, 1000, 2048]
    qlens = [1] * 4 + [17, 512, 2048]
    run_alternating_layers(lens, qlens, torch.bfloat16, (512, None, 512, None), 50.0, block_size=16)
