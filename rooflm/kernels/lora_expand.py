"""LoRA expand: y += h @ B_slot^T, shard by shard, for every token under an adapter, in Triton
(Punica's SGMV/BGMV; the second half of rooflm/kernels/lora_shrink.py).

Algorithm
---------
lora_b [S, OUT, R] holds slot s's B matrices with the adapter's scaling folded in, rows in the
fused linear's output order (q, k, v or gate, up). Shard i's output columns [off_i, off_i + size_i)
take h's columns [i R, (i + 1) R):

    y[t, off_i + j] += sum_r h[t, i R + r] * B[slot(t), off_i + j, r]

SGMV (prefill, mixed steps), one launch per shard (a fused linear has at most three): a program
per (segment, OUT block, M block) multiplies BLOCK_M gathered rows of h by the slot's B tile with
tl.dot and adds into y in place (each element of y belongs to one program: no atomics). BGMV
(decodes only), one launch for all shards: a program per (token, OUT block), each output column
reading its shard's columns of h and summing the shrink's K-split partials; decode steps are
latency-bound, so launches (one per linear, not per shard) are what it saves. The rank axis is padded to a power of two
>= 16 (tl.dot's smallest K) and masked.

Shapes
------
h [S, T, shards x R] fp32 partial sums (lora_shrink's), lora_b [S, OUT, R] with each slot contiguous (any slot stride),
y [T, OUT] (unit last stride), updated in place.

Work
----
FLOPs: 2 * Ta * R * OUT. Bytes: segments * OUT * R * e (B; BGMV: per token, mostly from L2)
+ 2 * Ta * OUT * e (y read and written) + Ta * shards * R * 4 (h). Memory-bound: y's read and
write dominate, which a fused epilogue in the base GEMM would save (later).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from rooflm.kernels.lora_shrink import slots_contiguous
from rooflm.kernels.utils import check_last_dim_contiguous


# --------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------

@triton.jit
def _sgmv_expand_kernel(h_ptr, b_ptr, y_ptr, order_ptr, starts_ptr, slots_ptr, OUT, R, h_col0, out_col0,
                        stride_hm, stride_bs, stride_bn, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    g = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_m = tl.program_id(2)
    start = tl.load(starts_ptr + g)
    end = tl.load(starts_ptr + g + 1)
    slot = tl.load(slots_ptr + g).to(tl.int64)
    rows = start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    tok = tl.load(order_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < OUT
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    bt = tl.load(b_ptr + slot * stride_bs + (out_col0 + offs_n)[:, None] * stride_bn + offs_r[None, :],
                 mask=n_ok[:, None] & r_ok[None, :], other=0.0)
    ht = tl.load(h_ptr + tok[:, None] * stride_hm + h_col0 + offs_r[None, :],
                 mask=row_ok[:, None] & r_ok[None, :], other=0.0).to(bt.dtype)
    acc = tl.dot(ht, tl.trans(bt))
    y_at = y_ptr + tok[:, None] * stride_ym + out_col0 + offs_n[None, :]
    mask = row_ok[:, None] & n_ok[None, :]
    y = tl.load(y_at, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_at, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bgmv_expand_kernel(h_ptr, b_ptr, y_ptr, order_ptr, token_slots_ptr, OUT, R, OFF1, OFF2, NUM_SPLITS,
                        stride_hs, stride_hm, stride_bs, stride_bn, stride_ym,
                        BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DENSE: tl.constexpr):
    # Every shard of the fused linear in one launch: output column c is in shard
    # (c >= OFF1) + (c >= OFF2) and takes h's columns [shard R, shard R + R). The shrink's K
    # splits are summed here, in a fixed order.
    # DENSE: one program per row of a CUDA graph's batch; slot -1 rows keep y as it is.
    if DENSE:
        tok = tl.program_id(0).to(tl.int64)
    else:
        tok = tl.load(order_ptr + tl.program_id(0)).to(tl.int64)
    slot = tl.load(token_slots_ptr + tok).to(tl.int64)
    if slot >= 0:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < OUT
        offs_r = tl.arange(0, BLOCK_R)
        r_ok = offs_r < R
        shard = (offs_n >= OFF1).to(tl.int32) + (offs_n >= OFF2).to(tl.int32)
        h_at = h_ptr + tok * stride_hm + shard[:, None] * R + offs_r[None, :]
        mask = n_ok[:, None] & r_ok[None, :]
        hr = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
        for split in range(0, NUM_SPLITS):
            hr += tl.load(h_at + split * stride_hs, mask=mask, other=0.0)
        bt = tl.load(b_ptr + slot * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :],
                     mask=mask, other=0.0).to(tl.float32)
        acc = tl.sum(bt * hr, axis=1)
        y_at = y_ptr + tok * stride_ym + offs_n
        y = tl.load(y_at, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(y_at, (y + acc).to(y_ptr.dtype.element_ty), mask=n_ok)


# --------------------------------------------------------------------------
# Wrapper
# --------------------------------------------------------------------------

def lora_expand(h: torch.Tensor, lora_b: torch.Tensor, y: torch.Tensor, shards: list[tuple[int, int]],
                rank: int, token_slots: torch.Tensor, token_order: Optional[torch.Tensor],
                seg_starts: Optional[torch.Tensor], seg_slots: Optional[torch.Tensor], max_seg_len: int,
                decode_only: bool) -> torch.Tensor:
    """y[t, shard i] += h[t, i R:(i + 1) R] @ B_{slot(t)}[shard i]^T in place, for the tokens in
    token_order, h summed over its partials (lora_shrink's [S, T, N]; a [T, N] h is one part).
    shards: (output offset, size) per shard, in h's order, tiling y's columns from 0.
    token_order None: every row, slot -1 skipped in the kernel (a CUDA graph's decode step)."""
    check_last_dim_contiguous("y", y)
    if h.dim() == 2:
        h = h.unsqueeze(0)
    if (lora_b.dim() != 3 or lora_b.shape[1] != y.shape[1] or lora_b.shape[2] != rank
            or not slots_contiguous(lora_b)):
        raise ValueError(f"lora_b must be [slots, {y.shape[1]}, {rank}], each slot contiguous, got "
                         f"{tuple(lora_b.shape)} with strides {lora_b.stride()}")
    if h.shape[2] != len(shards) * rank:
        raise ValueError(f"h has {h.shape[2]} columns, {len(shards)} shards of rank {rank} need {len(shards) * rank}")
    starts = [offset for offset, _ in shards]
    if len(shards) > 3 or starts != [sum(size for _, size in shards[:i]) for i in range(len(shards))]:
        raise ValueError(f"shards must be at most 3 that tile the output from column 0, got {shards}")
    dense = token_order is None
    if dense and not decode_only:
        raise ValueError("lora_expand without token_order (every row) is the decode-only kernel")
    num_tokens = y.shape[0] if dense else token_order.numel()
    if num_tokens == 0:
        return y
    block_r = max(16, triton.next_power_of_2(rank))
    if decode_only:
        out = y.shape[1]
        off1, off2 = (starts[1:] + [out, out])[:2]
        block_n = min(64, max(16, triton.next_power_of_2(out)))
        _bgmv_expand_kernel[(num_tokens, triton.cdiv(out, block_n))](
            h, lora_b, y, token_slots if dense else token_order, token_slots, out, rank, off1, off2, h.shape[0],
            h.stride(0), h.stride(1), lora_b.stride(0), lora_b.stride(1), y.stride(0),
            BLOCK_N=block_n, BLOCK_R=block_r, DENSE=dense)
        return y
    if h.shape[0] != 1:
        raise ValueError(f"the SGMV expand takes an unsplit h, got {h.shape[0]} partial sums")
    block_m = 16 if max_seg_len <= 16 else 32
    for i, (offset, size) in enumerate(shards):
        block_n = min(64, max(16, triton.next_power_of_2(size)))
        grid = (seg_slots.numel(), triton.cdiv(size, block_n), triton.cdiv(max_seg_len, block_m))
        _sgmv_expand_kernel[grid](h, lora_b, y, token_order, seg_starts, seg_slots, size, rank, i * rank, offset,
                                  h.stride(1), lora_b.stride(0), lora_b.stride(1), y.stride(0),
                                  BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r)
    return y


# --------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------

def lora_expand_ref(h: torch.Tensor, lora_b: torch.Tensor, y: torch.Tensor, shards: list[tuple[int, int]],
                    rank: int, token_slots: torch.Tensor) -> torch.Tensor:
    """A new y (y's dtype): y + the shards' h @ B^T in fp32 for tokens with slot >= 0."""
    out = y.float().clone()
    for slot in token_slots.unique().tolist():
        if slot < 0:
            continue
        idx = (token_slots == slot).nonzero().flatten()
        for i, (offset, size) in enumerate(shards):
            part = h[idx, i * rank:(i + 1) * rank] @ lora_b[slot, offset:offset + size].float().T
            out[idx, offset:offset + size] += part
    return out.to(y.dtype)
