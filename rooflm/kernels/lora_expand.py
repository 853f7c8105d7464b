"""LoRA expand: y += h @ B_slot^T, shard by shard, for every token under an adapter, in Triton
(Punica's SGMV; the second half of rooflm/kernels/lora_shrink.py, whose groups it shares).

Algorithm
---------
lora_b [S, OUT, R] holds slot s's B matrices with the adapter's scaling folded in, rows in the
fused linear's output order (q, k, v or gate, up). Shard i's output columns [off_i, off_i + size_i)
take h's columns [i R, (i + 1) R):

    y[t, off_i + j] += sum_r h[t, i R + r] * B[slot(t), off_i + j, r]

One launch for all shards of a fused linear (a decode step is latency-bound: launches count). A
program per (M tile of the shrink's, OUT block) loads the slot's B tile once for the tile's
BLOCK_M tokens of one group, and for each shard its block touches (one, but where a shard boundary falls inside the
block) sums the shrink's K-split partials once, as a [BLOCK_M, R] tile, then multiplies it by
the B tile with tl.dot and adds into y in place (each element of y belongs to one program: no
atomics; the splits are summed in a fixed order, so graphs and eager steps agree bit for bit).
Decode steps take wider OUT blocks, so the partial sums are read fewer times per byte of B.
The rank axis is padded to a power of two >= 16 (tl.dot's smallest K) and masked.

Shapes
------
h [S, T, shards x R] fp32 partial sums (lora_shrink's), lora_b [S, OUT, R] with each slot contiguous (any slot stride),
y [T, OUT] (unit last stride), updated in place.

Work
----
FLOPs: 2 * Ta * R * OUT. Bytes: tiles * OUT * R * e (B) + 2 * Ta * OUT * e
(y read and written) + S * Ta * shards * R * 4 * ceil(OUT / BLOCK_N) (h, mostly from L2).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from rooflm.kernels.lora_shrink import block_m_for, graph_segments, slot_tiles, slots_contiguous
from rooflm.kernels.utils import check_last_dim_contiguous, dot_precision


# --------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------

@triton.jit
def _sgmv_expand_kernel(h_ptr, b_ptr, y_ptr, order_ptr, starts_ptr, slots_ptr, tile_group_ptr, tile_row_ptr,
                        OUT, R, OFF1, OFF2, NUM_SPLITS,
                        stride_hs, stride_hm, stride_bs, stride_bn, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    g = tl.load(tile_group_ptr + tile)
    if g >= 0:  # else: a tile past the step's (lora_shrink.slot_tiles)
        end = tl.load(starts_ptr + g + 1)
        slot = tl.load(slots_ptr + g).to(tl.int64)
        rows = tl.load(tile_row_ptr + tile) + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        tok = tl.load(order_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        n0 = pid_n * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < OUT
        offs_r = tl.arange(0, BLOCK_R)
        r_ok = offs_r < R
        bt = tl.load(b_ptr + slot * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :],
                     mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        # Output column c is in shard (c >= OFF1) + (c >= OFF2); the block's shards are those
        # of its first and last columns.
        shard = (offs_n >= OFF1).to(tl.int32) + (offs_n >= OFF2).to(tl.int32)
        n_last = tl.minimum(n0 + BLOCK_N, OUT) - 1
        first = (n0 >= OFF1).to(tl.int32) + (n0 >= OFF2).to(tl.int32)
        last = (n_last >= OFF1).to(tl.int32) + (n_last >= OFF2).to(tl.int32)
        h_at = h_ptr + tok[:, None] * stride_hm + offs_r[None, :]
        h_mask = row_ok[:, None] & r_ok[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in range(first, last + 1):
            hs = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for split in range(0, NUM_SPLITS):
                hs += tl.load(h_at + split * stride_hs + s * R, mask=h_mask, other=0.0)
            part = tl.dot(hs.to(bt.dtype), tl.trans(bt), input_precision=DOT_PRECISION)
            acc = tl.where((shard == s)[None, :], part, acc)
        y_at = y_ptr + tok[:, None] * stride_ym + offs_n[None, :]
        mask = row_ok[:, None] & n_ok[None, :]
        y = tl.load(y_at, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_at, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------
# Wrapper
# --------------------------------------------------------------------------

def expand_block_n(out: int, decode_only: bool) -> int:
    """OUT columns per program. A decode program reads its tokens' partial sums (splits x R
    fp32 per token and shard) for each OUT block: wide blocks read them fewer times per byte of
    B, and the widest outputs (gate_up) still give hundreds of programs."""
    widest = (256 if out >= 16384 else 128) if decode_only else 64
    return min(widest, max(16, triton.next_power_of_2(out)))


def lora_expand(h: torch.Tensor, lora_b: torch.Tensor, y: torch.Tensor, shards: list[tuple[int, int]],
                rank: int, token_slots: torch.Tensor, token_order: Optional[torch.Tensor],
                seg_starts: Optional[torch.Tensor], seg_slots: Optional[torch.Tensor], max_seg_len: int,
                decode_only: bool, tiles: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """y[t, shard i] += h[t, i R:(i + 1) R] @ B_{slot(t)}[shard i]^T in place, for the tokens in
    token_order, h summed over its partials (lora_shrink's [S, T, N]; a [T, N] h is one part).
    shards: (output offset, size) per shard, in h's order, tiling y's columns from 0.
    token_order None: every slot's group from token_slots on the device (a graph's decode step).
    tiles: the shrink's (lora_shrink.slot_tiles), when the caller keeps them for the step."""
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
    if token_order is None:
        if not decode_only:
            raise ValueError("lora_expand without token_order (every slot's group) is the decode-only form")
        token_order, seg_starts, seg_slots = graph_segments(token_slots, lora_b.shape[0])
        max_seg_len = y.shape[0]
    if token_order.numel() == 0 or seg_slots.numel() == 0 or max_seg_len == 0:
        return y
    out = y.shape[1]
    off1, off2 = (starts[1:] + [out, out])[:2]
    block_n = expand_block_n(out, decode_only)
    block_m = block_m_for(max_seg_len, decode_only)
    tile_group, tile_row = tiles if tiles is not None else slot_tiles(seg_starts, token_order.numel(), block_m)
    grid = (tile_group.numel(), triton.cdiv(out, block_n))
    _sgmv_expand_kernel[grid](h, lora_b, y, token_order, seg_starts, seg_slots, tile_group, tile_row,
                              out, rank, off1, off2, h.shape[0],
                              h.stride(0), h.stride(1), lora_b.stride(0), lora_b.stride(1), y.stride(0),
                              BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=max(16, triton.next_power_of_2(rank)),
                              DOT_PRECISION=dot_precision(lora_b.dtype))
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
