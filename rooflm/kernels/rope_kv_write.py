"""Rotary position embedding fused with the KV-cache write, in Triton.

Algorithm
---------
For each token t at position p = positions[t], with c = cos(p * f_i) and
s = sin(p * f_i) read from a precomputed table (f_i the rotary frequencies;
Llama-3.1 scaling only changes the frequencies, so it only changes the table,
which the rotary layer builds), every head x of q and k is rotated pairwise:

    (x1, x2) -> (x1 * c - x2 * s,  x2 * c + x1 * s)

where the pair i is (x[i], x[i + D/2]) in the neox layout (HF's rotate_half,
Llama/Mistral/Qwen checkpoints in HF layout) and (x[2i], x[2i+1]) in the
interleaved layout (GPT-J, llama.cpp). A partial rotary (Phi-4-mini: R = 96 of
D = 128) rotates the first R elements as a neox head of width R and passes
the other D - R through. q is rotated in place; the rotated k
and the unchanged v go straight into their slot of the paged cache,
slot = slot_mapping[t] (block slot // block_size, offset slot % block_size;
-1 marks a padding token, not written). One pass, one program per token:
rotated k never round-trips through memory. The math is fp32, rounded once
to the storage dtype.

`write_kv` is the same kernel without the rotation: the plain KV-cache write
of the attention backend.

FP8 caches (layers/kv_cache.py): each head vector of rotated k and of v is
stored as x / s in E4M3 with s = max(|x|) / 448 written beside it (one fp32
per token and KV head), computed from the registers that already hold x;
or, with static scales ([H_kv], fixed per layer), as x / s clamped to +-448.

Shapes
------
q [T, H, D], k/v [T, H_kv, D]   (views of a fused qkv output are fine: any
                                  token and head strides, unit last stride)
positions [T] int64, cos_sin_cache [max_pos, R] fp32 (cos | sin halves; R = D,
                                  or R < D even for a partial rotary, neox only)
k/v cache [num_blocks, block_size, H_kv, D], slot_mapping [T] int64
k/v scale [num_blocks, block_size, H_kv] or static [H_kv] fp32 (FP8 caches only)

Work
----
FLOPs: ~6 per rotated pair, negligible.
Bytes: read q, k, v and D cos/sin values per token; write q, and k, v into
the cache: T * ((2H + 3 H_kv) * D * e + D * 4 + 16). Memory-bound: the
yardstick is GB/s against the device's copy bandwidth.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from rooflm.kernels.utils import (check_kv_scales, check_last_dim_contiguous, gdc_launch_dependents, gdc_wait,
                                  is_interpreter, next_power_of_2, pdl_supported, round_to_e4m3)
from rooflm.kernels.paged_attention_ref import has_token_scales


# --------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------

@triton.jit
def _rotate(row_ptr, head_offs, h_ok, offs_1, offs_2, i_ok, c, s):
    """Load the pairs (offs_1, offs_2) of every head of one token and rotate them in fp32."""
    mask = h_ok[:, None] & i_ok[None, :]
    x1 = tl.load(row_ptr + head_offs[:, None] + offs_1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row_ptr + head_offs[:, None] + offs_2[None, :], mask=mask, other=0.0).to(tl.float32)
    return x1 * c[None, :] - x2 * s[None, :], x2 * c[None, :] + x1 * s[None, :]


@triton.jit
def _fp8_scale(amax, scale_ptrs, mask):
    """Store and return the E4M3 scale of each head vector: max(|x|) / 448, never 0."""
    scale = tl.maximum(amax / 448.0, 1e-12)
    tl.store(scale_ptrs, scale, mask=mask)
    return scale


@triton.jit
def _saturate(x, IN_RANGE: tl.constexpr):
    """x clamped to E4M3's finite range (a static scale can leave values outside it)."""
    if IN_RANGE:
        return x
    return tl.minimum(tl.maximum(x, -448.0), 448.0)


@triton.jit
def _rope_kv_write_kernel(
        q_ptr, k_ptr, v_ptr, positions_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
        k_scale_ptr, v_scale_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos,
        stride_cb, stride_ct, stride_ch, stride_sb, stride_st,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
        KV_HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, IS_NEOX: tl.constexpr, APPLY_ROPE: tl.constexpr, FP8: tl.constexpr,
        ROUND_E4M3: tl.constexpr, PDL: tl.constexpr, TOKEN_SCALES: tl.constexpr = True,
        ROT_DIM: tl.constexpr = 0, PASS_PAD: tl.constexpr = 1, D_PAD: tl.constexpr = 0):
    """ROT_DIM: the rotated width (the head's, or fewer: the rest of k passes through to the
    cache, of q stays in place); HALF_PAD covers ROT_DIM // 2, PASS_PAD the passed-through
    HEAD_DIM - ROT_DIM, D_PAD the whole head (v)."""
    if PDL:  # launched early (programmatic dependent launch): wait for q, k, v
        gdc_launch_dependents()
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = ROT_DIM // 2
    PASS: tl.constexpr = HEAD_DIM - ROT_DIM
    offs_i = tl.arange(0, HALF_PAD)
    i_ok = offs_i < HALF
    # Element offsets of the two members of each rotated pair.
    if IS_NEOX:
        offs_1 = offs_i
        offs_2 = offs_i + HALF
    else:
        offs_1 = 2 * offs_i
        offs_2 = 2 * offs_i + 1

    kv_heads = tl.arange(0, KV_HEADS_PAD)
    kv_ok = kv_heads < NUM_KV_HEADS
    if APPLY_ROPE:
        pos = tl.load(positions_ptr + t)
        c = tl.load(cos_sin_ptr + pos * stride_cos + offs_i, mask=i_ok, other=0.0)
        s = tl.load(cos_sin_ptr + pos * stride_cos + HALF + offs_i, mask=i_ok, other=0.0)
        # q: rotate in place.
        heads = tl.arange(0, HEADS_PAD)
        h_ok = heads < NUM_HEADS
        q_row = q_ptr + t * stride_qt
        q1, q2 = _rotate(q_row, heads * stride_qh, h_ok, offs_1, offs_2, i_ok, c, s)
        q_mask = h_ok[:, None] & i_ok[None, :]
        q_dtype = q_ptr.dtype.element_ty
        tl.store(q_row + heads[:, None] * stride_qh + offs_1[None, :], q1.to(q_dtype), mask=q_mask)
        tl.store(q_row + heads[:, None] * stride_qh + offs_2[None, :], q2.to(q_dtype), mask=q_mask)

    slot = tl.load(slot_mapping_ptr + t)
    if slot >= 0:
        cache_offs = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct
        kv_mask = kv_ok[:, None] & i_ok[None, :]
        cache_dtype = k_cache_ptr.dtype.element_ty
        k_row = k_ptr + t * stride_kt
        kc_row = k_cache_ptr + cache_offs + kv_heads[:, None] * stride_ch
        if APPLY_ROPE:
            k1, k2 = _rotate(k_row, kv_heads * stride_kh, kv_ok, offs_1, offs_2, i_ok, c, s)
        else:
            k1 = tl.load(k_row + kv_heads[:, None] * stride_kh + offs_1[None, :], mask=kv_mask, other=0.0)
            k2 = tl.load(k_row + kv_heads[:, None] * stride_kh + offs_2[None, :], mask=kv_mask, other=0.0)
        if PASS > 0:  # a partial rotary's unrotated tail of k
            offs_p = ROT_DIM + tl.arange(0, PASS_PAD)
            p_mask = kv_ok[:, None] & (offs_p < HEAD_DIM)[None, :]
            kp = tl.load(k_row + kv_heads[:, None] * stride_kh + offs_p[None, :], mask=p_mask, other=0.0)
        # v is copied whole, not in pairs.
        offs_d = tl.arange(0, D_PAD)
        v_mask = kv_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
        v = tl.load(v_ptr + t * stride_vt + kv_heads[:, None] * stride_vh + offs_d[None, :], mask=v_mask,
                    other=0.0)
        if FP8:
            k1 = k1.to(tl.float32)
            k2 = k2.to(tl.float32)
            v = v.to(tl.float32)
            if TOKEN_SCALES:  # one scale per head vector, from the values already in registers
                scale_offs = (slot // BLOCK_SIZE) * stride_sb + (slot % BLOCK_SIZE) * stride_st + kv_heads
                k_amax = tl.maximum(tl.max(tl.abs(k1), 1), tl.max(tl.abs(k2), 1))
                if PASS > 0:
                    k_amax = tl.maximum(k_amax, tl.max(tl.abs(kp.to(tl.float32)), 1))
                ks = _fp8_scale(k_amax, k_scale_ptr + scale_offs, kv_ok)
                vs = _fp8_scale(tl.max(tl.abs(v), 1), v_scale_ptr + scale_offs, kv_ok)
            else:  # static scales, one per KV head: saturate what falls outside E4M3's range
                ks = tl.load(k_scale_ptr + kv_heads, mask=kv_ok, other=1.0)
                vs = tl.load(v_scale_ptr + kv_heads, mask=kv_ok, other=1.0)
            k1 = _saturate(k1 / ks[:, None], TOKEN_SCALES)
            k2 = _saturate(k2 / ks[:, None], TOKEN_SCALES)
            v = _saturate(v / vs[:, None], TOKEN_SCALES)
            if PASS > 0:
                kp = _saturate(kp.to(tl.float32) / ks[:, None], TOKEN_SCALES)
            if ROUND_E4M3:
                k1 = round_to_e4m3(k1)
                k2 = round_to_e4m3(k2)
                v = round_to_e4m3(v)
                if PASS > 0:
                    kp = round_to_e4m3(kp)
        tl.store(kc_row + offs_1[None, :], k1.to(cache_dtype), mask=kv_mask)
        tl.store(kc_row + offs_2[None, :], k2.to(cache_dtype), mask=kv_mask)
        if PASS > 0:
            tl.store(kc_row + offs_p[None, :], kp.to(cache_dtype), mask=p_mask)
        tl.store(v_cache_ptr + cache_offs + kv_heads[:, None] * stride_ch + offs_d[None, :],
                 v.to(cache_dtype), mask=v_mask)


# --------------------------------------------------------------------------
# Wrappers
# --------------------------------------------------------------------------

def _check_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor, k_scale: Optional[torch.Tensor],
              v_scale: Optional[torch.Tensor]) -> None:
    check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    if k_cache.dim() != 4 or k_cache.shape[2:] != (num_kv_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache {tuple(k_cache.shape)} / {tuple(v_cache.shape)} does not fit k {tuple(k.shape)}")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share strides")
    block_size = k_cache.shape[1]
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64 [{num_tokens}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, t)


def _num_warps(elements: int) -> int:
    return 8 if elements >= 8192 else 4 if elements >= 2048 else 2


def rope_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, is_neox: bool = True, k_scale: Optional[torch.Tensor] = None,
                  v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rotate q in place and write rotated k and v into their cache slots; returns q.

    q [T, H, D], k/v [T, H_kv, D] (strided views allowed), positions [T] int64,
    cos_sin_cache [max_pos, R] fp32 with cos in the first R/2 columns and sin
    in the last R/2 (R = D, or fewer for a partial rotary: the first R elements
    of each head rotate, neox only), slot_mapping [T] int64 (-1: do not write). k itself is
    not modified. FP8 caches take k_scale / v_scale [num_blocks, block_size, H_kv] or static [H_kv] fp32.
    """
    _check_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    num_tokens, num_heads, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} do not match")
    if positions.shape != (num_tokens,) or positions.dtype != torch.int64:
        raise ValueError(f"positions must be int64 [{num_tokens}], got {positions.dtype} {tuple(positions.shape)}")
    rot = cos_sin_cache.shape[1] if cos_sin_cache.dim() == 2 else -1
    if rot <= 0 or rot > head_dim or rot % 2 or cos_sin_cache.dtype != torch.float32:
        raise ValueError(f"cos_sin_cache must be fp32 [max_pos, R] with R even and at most {head_dim}, got "
                         f"{cos_sin_cache.dtype} {tuple(cos_sin_cache.shape)}")
    if rot < head_dim and not is_neox:
        raise ValueError("a partial rotary (cos_sin_cache narrower than the head) is neox-layout only")
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("cos_sin_cache", cos_sin_cache)
    if num_tokens == 0:
        return q
    _launch(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, is_neox, True, k_scale, v_scale,
            rot_dim=rot)
    return q


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: Optional[torch.Tensor] = None,
             v_scale: Optional[torch.Tensor] = None) -> None:
    """Store k, v [T, H_kv, D] into their cache slots (slot -1: skip); no rotation."""
    _check_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if k.shape[0] == 0:
        return
    _launch(k, k, v, slot_mapping, k, k_cache, v_cache, slot_mapping, True, False, k_scale, v_scale)


def _launch(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, is_neox, apply_rope,
            k_scale, v_scale, rot_dim=None):
    num_tokens, num_kv_heads, head_dim = k.shape
    rot_dim = rot_dim or head_dim
    num_heads = q.shape[1] if apply_rope else 0
    half_pad = next_power_of_2(rot_dim // 2)
    kv_heads_pad = next_power_of_2(num_kv_heads)
    heads_pad = next_power_of_2(num_heads) if apply_rope else 1
    pdl = pdl_supported(q.device)
    fp8 = k_scale is not None
    token_scales = has_token_scales(k_scale)
    scale_strides = (k_scale.stride(0), k_scale.stride(1)) if token_scales else (0, 0)
    _rope_kv_write_kernel[(num_tokens,)](
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
        k_scale if fp8 else k_cache, v_scale if fp8 else v_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0) if apply_rope else 0,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *scale_strides,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEADS_PAD=heads_pad, KV_HEADS_PAD=kv_heads_pad,
        HEAD_DIM=head_dim, HALF_PAD=half_pad, BLOCK_SIZE=k_cache.shape[1], IS_NEOX=is_neox,
        APPLY_ROPE=apply_rope, FP8=fp8, ROUND_E4M3=fp8 and is_interpreter(), PDL=pdl, TOKEN_SCALES=token_scales,
        ROT_DIM=rot_dim, PASS_PAD=next_power_of_2(max(head_dim - rot_dim, 1)), D_PAD=next_power_of_2(head_dim),
        num_warps=_num_warps((heads_pad + 3 * kv_heads_pad) * half_pad),
        **({"launch_pdl": True} if pdl else {}),
    )


# --------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------

def rotate_ref(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
               is_neox: bool = True) -> torch.Tensor:
    """Torch rotary on [T, heads, D] in fp32: neox uses rotate_half, interleaved rotates (2i, 2i+1).
    A table narrower than D (R columns) rotates x[..., :R] and passes the rest through."""
    rot = cos_sin_cache.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat([rotate_ref(x[..., :rot], positions, cos_sin_cache, is_neox), x[..., rot:]], dim=-1)
    half = x.shape[-1] // 2
    cos = cos_sin_cache[positions, :half].float()[:, None, :]
    sin = cos_sin_cache[positions, half:].float()[:, None, :]
    xf = x.float()
    if is_neox:
        cos = torch.cat([cos, cos], dim=-1)
        sin = torch.cat([sin, sin], dim=-1)
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)  # rotate_half
    else:
        cos = cos.repeat_interleave(2, dim=-1)
        sin = sin.repeat_interleave(2, dim=-1)
        rotated = torch.stack([-xf[..., 1::2], xf[..., 0::2]], dim=-1).flatten(-2)
    return (xf * cos + rotated * sin).to(x.dtype)


def rope_kv_write_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, is_neox: bool = True, k_scale: Optional[torch.Tensor] = None,
                      v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Same contract as rope_kv_write, in torch: rotates q in place, writes the cache, returns q."""
    from rooflm.kernels.paged_attention_ref import write_kv_ref

    q.copy_(rotate_ref(q, positions, cos_sin_cache, is_neox))
    # The kernel quantizes the rotated k before rounding it to k's dtype: so does the reference.
    k_rot = rotate_ref(k.float(), positions, cos_sin_cache, is_neox) if k_scale is not None else \
        rotate_ref(k, positions, cos_sin_cache, is_neox)
    write_kv_ref(k_rot, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q


def rope_kv_write_bytes(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
                        elem_bytes: int, cache_elem_bytes: Optional[int] = None) -> int:
    """Bytes rope_kv_write must move: q read + written, k and v read and written to the cache, cos/sin, indices."""
    cache_elem_bytes = cache_elem_bytes or elem_bytes
    per_token = (2 * num_heads * head_dim * elem_bytes + 2 * num_kv_heads * head_dim * elem_bytes
                 + 2 * num_kv_heads * head_dim * cache_elem_bytes + head_dim * 4 + 16)
    return num_tokens * per_token
