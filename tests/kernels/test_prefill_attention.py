"""Prefill attention (rooflm/kernels/prefill_attention.py) against the paged reference."""

import pytest
import torch

from tests.kernels.helpers import DEVICE, assert_close, random_paged_batch
from rooflm.kernels.prefill_attention import prefill_attention, prefill_attention_ref, visible_pairs


def run_case(seq_lens, query_lens, num_kv_heads, group, head_dim, block_size, dtype, window,
             config=None):
    meta, k_cache, v_cache = random_paged_batch(seq_lens, query_lens, num_kv_heads, head_dim,
                                                block_size, dtype, DEVICE)
    num_tokens = meta.query_start_loc_cpu[-1]
    q = torch.randn(num_tokens, num_kv_heads * group, head_dim, device=DEVICE).to(dtype)
    out = torch.full_like(q, float("nan"))
    scale = head_dim ** -0.5
    prefill_attention(q, k_cache, v_cache, meta, scale, window, out=out, config=config)
    ref = prefill_attention_ref(q, k_cache, v_cache, meta, scale, window)
    assert_close(out, ref, dtype, f"prefill {seq_lens=} {query_lens=}")


# (seq_lens, query_lens, H_kv, group, head_dim, block_size, dtype, sliding_window)
CASES = [
    ([17], [17], 2, 4, 64, 16, torch.float16, None),                   # GQA 4
    ([1], [1], 1, 1, 128, 16, torch.float32, None),                    # one token
    ([97], [97], 1, 8, 80, 32, torch.float16, None),                   # GQA 8, D 80, 97 % 32 != 0
    ([1000], [37], 1, 4, 96, 16, torch.float16, None),                 # chunk / prefix hit at 1000
    ([1, 1, 250, 61], [1, 1, 250, 20], 2, 1, 128, 32, torch.float16, 64),  # mixed batch, MHA, window
    ([33, 70], [33, 70], 1, 4, 256, 16, torch.float32, None),          # D 256, MQA
    ([200], [200], 1, 4, 64, 16, torch.float16, 17),                   # window narrower than a tile
    ([1000], [1000], 1, 1, 64, 32, torch.float16, None),               # full prefill of 1000
    ([40, 19, 3], [9, 19, 2], 2, 2, 128, 16, torch.float32, 10),       # several chunks, window
    ([45, 12], [45, 12], 2, 7, 64, 16, torch.float16, None),           # group of 7 (Qwen 14/2)
]


@pytest.mark.parametrize("seq_lens,query_lens,num_kv_heads,group,head_dim,block_size,dtype,window", CASES)
def test_prefill_matches_reference(seq_lens, query_lens, num_kv_heads, group, head_dim, block_size,
                                   dtype, window):
    torch.manual_seed(hash((tuple(seq_lens), head_dim, block_size)) % 2**31)
    run_case(seq_lens, query_lens, num_kv_heads, group, head_dim, block_size, dtype, window)


@pytest.mark.parametrize("block_n,block_size", [(16, 32), (32, 16)])
def test_prefill_key_tile_vs_block_size(block_n, block_size):
    # A key tile inside one cache block (one table entry) and spanning several (one per key).
    run_case([61, 5], [61, 5], 1, 4, 64, block_size, torch.float16, None, config=(32, block_n, 4, 2))


def test_prefill_leaves_other_rows_untouched():
    meta, k_cache, v_cache = random_paged_batch([5, 30], [1, 30], 1, 64, 16, torch.float16, DEVICE)
    q = torch.randn(31, 2, 64, device=DEVICE).to(torch.float16)
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, k_cache, v_cache, meta, 0.125, out=out, first_seq=1)
    assert torch.isnan(out[0]).all()
    ref = prefill_attention_ref(q, k_cache, v_cache, meta, 0.125)
    assert_close(out[1:], ref[1:], torch.float16)


def test_visible_pairs_counts_keys():
    for first, end, window in [(0, 10, None), (5, 9, None), (0, 10, 3), (7, 20, 4), (2, 3, 100)]:
        expected = sum(min(p + 1, window or p + 1) for p in range(first, end))
        assert visible_pairs(first, end, window) == expected


def test_prefill_rejects_bad_inputs():
    meta, k_cache, v_cache = random_paged_batch([8], [8], 1, 64, 16, torch.float16, DEVICE)
    q = torch.randn(8, 2, 32, device=DEVICE).to(torch.float16)
    with pytest.raises(ValueError):
        prefill_attention(q, k_cache, v_cache, meta, 0.125)  # head dim differs from the cache's
    q = torch.randn(8, 2, 64, device=DEVICE).to(torch.float32)
    with pytest.raises(TypeError):
        prefill_attention(q, k_cache, v_cache, meta, 0.125)


# -- GPU only: bf16 and large shapes -----------------------------------------------------------

GPU_CASES = [
    ([2048, 2048], [2048, 2048], 8, 4, 128, 16, torch.bfloat16, None),
    ([3000, 1, 700], [512, 1, 700], 8, 4, 128, 256, torch.bfloat16, None),
    ([1500], [1500], 2, 4, 64, 32, torch.bfloat16, 256),
    ([900, 77], [900, 77], 2, 8, 256, 16, torch.bfloat16, None),
    ([600], [600], 4, 1, 80, 16, torch.bfloat16, None),
    ([600], [100], 4, 4, 96, 64, torch.float16, None),
    ([4096], [4096], 8, 4, 128, 128, torch.float16, 1000),
]


@pytest.mark.gpu
@pytest.mark.parametrize("seq_lens,query_lens,num_kv_heads,group,head_dim,block_size,dtype,window", GPU_CASES)
def test_prefill_gpu(seq_lens, query_lens, num_kv_heads, group, head_dim, block_size, dtype, window):
    run_case(seq_lens, query_lens, num_kv_heads, group, head_dim, block_size, dtype, window)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_prefill_gpu_bf16(case):
    seq_lens, query_lens, num_kv_heads, group, head_dim, block_size, _, window = case
    run_case(seq_lens, query_lens, num_kv_heads, group, head_dim, block_size, torch.bfloat16, window)


@pytest.mark.parametrize("block_size,window", [(32, None), (64, 40)])
def test_prefill_tma_path(block_size, window):
    # Whole key tiles through tensor descriptors (the GPU's default where it applies).
    meta, k_cache, v_cache = random_paged_batch([150, 70], [100, 70], 2, 64, block_size, torch.float16, DEVICE)
    q = torch.randn(170, 8, 64, device=DEVICE).to(torch.float16)
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, k_cache, v_cache, meta, 0.125, window, out=out, config=(32, 32, 4, 2), use_tma=True)
    assert_close(out, prefill_attention_ref(q, k_cache, v_cache, meta, 0.125, window), torch.float16)


def test_prefill_tma_request_that_cannot_apply_raises():
    # A key tile wider than the cache block cannot be one TMA box.
    meta, k_cache, v_cache = random_paged_batch([40], [40], 1, 64, 16, torch.float16, DEVICE)
    q = torch.randn(40, 2, 64, device=DEVICE).to(torch.float16)
    with pytest.raises(ValueError):
        prefill_attention(q, k_cache, v_cache, meta, 0.125, config=(32, 32, 4, 2), use_tma=True)


def test_prefill_tma_with_table_config():
    meta, k_cache, v_cache = random_paged_batch([90, 33], [50, 33], 2, 128, 64, torch.float16, DEVICE)
    q = torch.randn(83, 4, 128, device=DEVICE).to(torch.float16)
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, k_cache, v_cache, meta, 128 ** -0.5, out=out, use_tma=True)
    assert_close(out, prefill_attention_ref(q, k_cache, v_cache, meta, 128 ** -0.5), torch.float16)
