"""Fused RoPE + KV-cache write (rooflm/kernels/rope_kv_write.py) against the torch rotary."""

import math

import pytest
import torch

from tests.kernels.helpers import DEVICE, assert_close
from rooflm.kernels.rope_kv_write import rope_kv_write, rope_kv_write_ref, rotate_ref, write_kv
from rooflm.kernels.paged_attention_ref import write_kv_ref


def cos_sin_table(head_dim, max_pos, theta=10000.0, llama3=False):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if llama3:
        # Llama-3.1 scaling (factor 8, low 1, high 4, original 8192): only the table changes.
        factor, low, high, orig = 8.0, 1.0, 4.0, 8192
        wavelen = 2 * math.pi / inv_freq
        smooth = (orig / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > orig / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= orig / low) & (wavelen >= orig / high)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    freqs = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float().to(DEVICE)


def run_case(num_tokens, num_heads, num_kv_heads, head_dim, block_size, dtype, is_neox, llama3=False,
             fused_qkv=True, rotary_dim=None):
    max_pos = 4096
    if fused_qkv:  # q, k, v as strided views of one qkv projection output
        qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE).to(dtype)
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        q = q.view(num_tokens, num_heads, head_dim)
        k = k.view(num_tokens, num_kv_heads, head_dim)
        v = v.view(num_tokens, num_kv_heads, head_dim)
    else:
        q = torch.randn(num_tokens, num_heads, head_dim, device=DEVICE).to(dtype)
        k = torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE).to(dtype)
        v = torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    positions = torch.randint(0, max_pos, (num_tokens,), device=DEVICE)
    table = cos_sin_table(rotary_dim or head_dim, max_pos, llama3=llama3)
    num_blocks = (2 * num_tokens) // block_size + 2
    slot_mapping = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slot_mapping[::3] = -1  # padding tokens are not written
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    q_ref, k_cache_ref, v_cache_ref = q.clone(), k_cache.clone(), v_cache.clone()
    k_before, v_before = k.clone(), v.clone()

    returned = rope_kv_write(q, k, v, positions, table, k_cache, v_cache, slot_mapping, is_neox)
    rope_kv_write_ref(q_ref, k.clone(), v.clone(), positions, table, k_cache_ref, v_cache_ref, slot_mapping,
                      is_neox)

    assert returned.data_ptr() == q.data_ptr()
    assert_close(q, q_ref, dtype, "q")
    written = slot_mapping[slot_mapping >= 0]
    flat = lambda c: c.view(-1, num_kv_heads, head_dim)  # noqa: E731
    assert_close(flat(k_cache)[written], flat(k_cache_ref)[written], dtype, "k cache")
    assert torch.equal(flat(v_cache)[written], flat(v_cache_ref)[written])
    # Slots not in the mapping stay untouched; k and v themselves are not modified.
    assert torch.isnan(k_cache).sum() == torch.isnan(k_cache_ref).sum() > 0
    assert torch.isnan(v_cache).sum() == torch.isnan(v_cache_ref).sum()
    assert torch.equal(k, k_before) and torch.equal(v, v_before)


CASES = [
    # (T, H, H_kv, D, block_size, dtype, is_neox)
    (7, 4, 2, 64, 16, torch.float16, True),
    (5, 8, 1, 80, 32, torch.float32, False),
    (9, 2, 2, 96, 16, torch.float16, False),
    (3, 4, 1, 128, 16, torch.float32, True),
    (4, 8, 8, 256, 32, torch.float16, True),
]


@pytest.mark.parametrize("num_tokens,num_heads,num_kv_heads,head_dim,block_size,dtype,is_neox", CASES)
def test_rope_kv_write_matches_reference(num_tokens, num_heads, num_kv_heads, head_dim, block_size, dtype,
                                         is_neox):
    run_case(num_tokens, num_heads, num_kv_heads, head_dim, block_size, dtype, is_neox)


@pytest.mark.parametrize("head_dim,rotary_dim,dtype", [(128, 96, torch.float16), (64, 32, torch.float32),
                                                      (80, 40, torch.float16)])
def test_rope_kv_write_partial_rotary(head_dim, rotary_dim, dtype):
    """Phi-4-mini's partial rotary: the first R elements of each head rotate (neox over R), the
    rest of q stays and of k goes to the cache unrotated; in the fused kernel, not torch."""
    run_case(6, 4, 2, head_dim, 16, dtype, True, rotary_dim=rotary_dim)


def test_partial_rotary_is_neox_only():
    q = torch.randn(2, 2, 64, device=DEVICE)
    k = v = torch.randn(2, 1, 64, device=DEVICE)
    cache = torch.zeros(2, 16, 1, 64, device=DEVICE)
    with pytest.raises(ValueError, match="neox"):
        rope_kv_write(q, k, v, torch.zeros(2, dtype=torch.int64, device=DEVICE), cos_sin_table(32, 8),
                      cache, cache.clone(), torch.zeros(2, dtype=torch.int64, device=DEVICE), is_neox=False)


def test_rope_llama3_table_and_contiguous_inputs():
    run_case(6, 4, 2, 64, 16, torch.float32, True, llama3=True, fused_qkv=False)


def test_rotate_ref_neox_matches_hf_rotate_half():
    # HF: q * cos + rotate_half(q) * sin with cos/sin duplicated over both halves.
    x = torch.randn(3, 2, 8, device=DEVICE)
    positions = torch.tensor([0, 5, 9], device=DEVICE)
    table = cos_sin_table(8, 16)
    cos = torch.cat([table[positions, :4]] * 2, dim=-1)[:, None]
    sin = torch.cat([table[positions, 4:]] * 2, dim=-1)[:, None]
    rotate_half = torch.cat([-x[..., 4:], x[..., :4]], dim=-1)
    torch.testing.assert_close(rotate_ref(x, positions, table, True), x * cos + rotate_half * sin)


def test_write_kv_matches_reference():
    k = torch.randn(10, 2, 64, device=DEVICE).to(torch.float16)
    v = torch.randn(10, 2, 64, device=DEVICE).to(torch.float16)
    slot_mapping = torch.randperm(64, device=DEVICE)[:10]
    slot_mapping[3] = -1
    k_cache = torch.full((4, 16, 2, 64), float("nan"), dtype=torch.float16, device=DEVICE)
    v_cache = k_cache.clone()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv(k, v, k_cache, v_cache, slot_mapping)
    write_kv_ref(k, v, k_ref, v_ref, slot_mapping)
    assert torch.equal(k_cache.nan_to_num(7.0), k_ref.nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), v_ref.nan_to_num(7.0))


# -- GPU only: bf16 and large shapes -----------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("num_tokens,num_heads,num_kv_heads,head_dim,block_size",
                         [(4096, 32, 8, 128, 16), (1000, 14, 2, 64, 256), (333, 16, 16, 256, 32),
                          (77, 32, 8, 80, 16), (1, 32, 8, 128, 16)])
def test_rope_kv_write_gpu_bf16(num_tokens, num_heads, num_kv_heads, head_dim, block_size, is_neox):
    run_case(num_tokens, num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16, is_neox, llama3=True)
