"""Paged split-KV decode attention (rooflm/kernels/decode_attention.py) against the paged reference."""

import pytest
import torch

from tests.kernels.helpers import DEVICE, assert_close, random_paged_batch
from rooflm.kernels.decode_attention import (decode_attention, decode_attention_ref, decode_num_splits,
                                             plan_decode_attention)


def run_case(seq_lens, num_kv_heads, group, head_dim, block_size, dtype, window, num_splits, config=None):
    meta, k_cache, v_cache = random_paged_batch(seq_lens, [1] * len(seq_lens), num_kv_heads, head_dim,
                                                block_size, dtype, DEVICE)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, device=DEVICE).to(dtype)
    out = torch.full_like(q, float("nan"))
    scale = head_dim ** -0.5
    plan = plan_decode_attention(q, k_cache, v_cache, meta, window, out=out, num_splits=num_splits,
                                 config=config)
    if plan.num_splits > 1:  # stale partials from an earlier step: the reduce must read only filled splits
        plan.part_out.fill_(float("nan"))
        plan.part_lse.fill_(float("nan"))
    decode_attention(q, k_cache, v_cache, meta, scale, window, out=out, plan=plan)
    ref = decode_attention_ref(q, k_cache, v_cache, meta, scale, window)
    assert_close(out, ref, dtype, f"decode {seq_lens=} {num_splits=}")


# (seq_lens, H_kv, group, head_dim, block_size, dtype, sliding_window, num_splits; None = heuristic)
CASES = [
    ([1, 17, 97], 2, 4, 64, 16, torch.float16, None, None),         # GQA 4, short contexts
    ([1000], 1, 8, 128, 32, torch.float16, None, None),             # one long sequence, auto splits
    ([1000, 5, 300], 2, 1, 80, 16, torch.float32, None, 1),         # MHA, D 80, no split
    ([50, 600], 1, 4, 96, 32, torch.float16, 100, 3),               # sliding window, D 96
    ([300], 1, 4, 256, 16, torch.float32, None, 7),                 # D 256, uneven splits
    ([130, 7, 1], 1, 16, 64, 16, torch.float16, None, 4),           # MQA, empty splits
    ([33, 64], 2, 4, 128, 32, torch.float16, 1000, 2),              # window wider than the context
    ([45, 12], 2, 7, 64, 16, torch.float32, 20, 3),                 # group of 7, window
]


@pytest.mark.parametrize("seq_lens,num_kv_heads,group,head_dim,block_size,dtype,window,num_splits", CASES)
def test_decode_matches_reference(seq_lens, num_kv_heads, group, head_dim, block_size, dtype, window,
                                  num_splits):
    torch.manual_seed(hash((tuple(seq_lens), head_dim, block_size)) % 2**31)
    run_case(seq_lens, num_kv_heads, group, head_dim, block_size, dtype, window, num_splits)


def test_short_contexts_in_a_grid_sized_for_a_long_span():
    """A graph's split count follows the model's context length: a short sequence fills the first
    few splits (whole key tiles) and the reduce reads no split it left empty (NaN partials here)."""
    torch.manual_seed(5)
    run_case([40, 700, 5, 300], 2, 4, 64, 16, torch.float16, None, 48)
    run_case([40, 700], 2, 4, 64, 16, torch.float16, 64, 48)  # a window: the span is the window


@pytest.mark.parametrize("block_n,block_size", [(16, 32), (32, 16)])
def test_decode_key_tile_vs_block_size(block_n, block_size):
    run_case([77, 3], 1, 4, 64, block_size, torch.float16, None, 2, config=(block_n, 4, 2))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_key_tile_filling_a_block(num_splits):
    # A tile as large as a block: offsets from one table entry with one split, key by key with more.
    run_case([77, 130, 3], 2, 4, 64, 32, torch.float16, None, num_splits, config=(32, 4, 2))


def test_decode_only_writes_decode_rows():
    meta, k_cache, v_cache = random_paged_batch([9, 20, 30], [1, 1, 30], 1, 64, 16, torch.float16, DEVICE)
    q = torch.randn(32, 4, 64, device=DEVICE).to(torch.float16)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, k_cache, v_cache, meta, 0.125, out=out)
    assert torch.isnan(out[2:]).all()
    ref = decode_attention_ref(q, k_cache, v_cache, meta, 0.125)
    assert_close(out[:2], ref[:2], torch.float16)


def test_decode_rejects_multi_token_sequences():
    meta, k_cache, v_cache = random_paged_batch([9, 20], [1, 5], 1, 64, 16, torch.float16, DEVICE)
    q = torch.randn(6, 1, 64, device=DEVICE).to(torch.float16)
    with pytest.raises(ValueError):
        decode_attention(q, k_cache, v_cache, meta, 0.125, num_seqs=2)


def test_num_splits_heuristic():
    assert decode_num_splits(1, 8, 100) == 1             # short: one split
    assert decode_num_splits(1, 1, 100_000) > 1          # one long sequence is split
    assert decode_num_splits(4096, 8, 4096) == 1         # a big batch fills the GPU by itself


# -- GPU only: bf16 and large shapes -----------------------------------------------------------

GPU_CASES = [
    ([4096] * 8 + [2048] * 8, 8, 4, 128, 16, torch.bfloat16, None, None),
    ([8192], 8, 4, 128, 16, torch.bfloat16, None, None),
    ([8192, 100], 8, 4, 128, 256, torch.bfloat16, None, None),
    ([3000, 1, 17], 2, 8, 256, 32, torch.bfloat16, None, None),
    ([5000, 4000], 4, 1, 64, 64, torch.bfloat16, 4096, None),
    ([2500], 8, 4, 80, 128, torch.float16, None, 5),
]


@pytest.mark.gpu
@pytest.mark.parametrize("seq_lens,num_kv_heads,group,head_dim,block_size,dtype,window,num_splits", GPU_CASES)
def test_decode_gpu(seq_lens, num_kv_heads, group, head_dim, block_size, dtype, window, num_splits):
    run_case(seq_lens, num_kv_heads, group, head_dim, block_size, dtype, window, num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_decode_gpu_bf16(case):
    seq_lens, num_kv_heads, group, head_dim, block_size, _, window, num_splits = case
    run_case(seq_lens, num_kv_heads, group, head_dim, block_size, torch.bfloat16, window, num_splits)


def test_decode_repeated_calls_agree():
    # The split path twice in a row on the same inputs: same answer (no state carried over).
    meta, k_cache, v_cache = random_paged_batch([200, 3, 90], [1, 1, 1], 2, 64, 16, torch.float16, DEVICE)
    q = torch.randn(3, 8, 64, device=DEVICE).to(torch.float16)
    ref = decode_attention_ref(q, k_cache, v_cache, meta, 0.125)
    outs = []
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        decode_attention(q, k_cache, v_cache, meta, 0.125, out=out, num_splits=5)
        assert_close(out, ref, torch.float16)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
