"""LoRA shrink: h = x @ A_slot^T for every token under an adapter, in Triton (Punica's SGMV).

Algorithm
---------
A batch mixes tokens of many adapters and of none. Each adapter lives in a slot of a fixed pool:
lora_a [S, N, K] holds slot s's A matrices (a fused linear's shards stacked along N: q, k, v
each rank R rows, so N = shards x R). Tokens are grouped by slot: group g is
token_order[seg_starts[g]:seg_starts[g+1]], all under slot seg_slots[g].

One kernel for every step: a program per (M tile, N block, K split) gathers a tile's BLOCK_M
token rows of x (all of one group) and multiplies them by the slot's A tile with tl.dot, so a
slot's A is read once per BLOCK_M of its tokens, never once per token (a decode batch of 64
tokens over 16 adapters reads 16 A's, not 64). The tiles (slot_tiles: group, first row) are a
table on the device whose length bounds the step's, min(tokens, ceil(tokens / BLOCK_M) +
groups); a program of a padding tile exits at once.

  * Eager steps: the groups are the step's non-empty slots (rooflm/lora/mapping.py, on the host).
  * A CUDA graph's decode step (token_order None here, or the mapping's graph form): the groups
    are ALL slots, seg_slots = 0..S-1, their starts and tiles computed on the device from the
    graph's static token_slots (graph_segments, slot_tiles): a grid fixed by the batch size and
    the slot count.
  * Decode steps split K (decode_splits) so that a small batch still fills the GPU: at batch 1
    one program would stream a whole A ([48, 4096] bf16, 384 KiB) alone. Each split writes its
    partial sums; lora_expand adds them once per shard (no atomics: the order is fixed). The
    split count and the tiles are functions of the shapes and the slot count only, never of the
    step's tokens, so a graph's step and an eager step give the same bits for a token.
  * Prefill and mixed steps (never captured) split K by the step's tile count (prefill_splits),
    so a step of a few hundred tokens still fills the GPU.

h is fp32 [S, T, N] partial sums (S = 1 unsplit); rows of tokens without an adapter are
undefined (the expand skips them).

Shapes
------
x [T, K] (unit last stride), lora_a [S, N, K] with each slot contiguous (any slot stride: the
hooks' are views into one pool whose row is a whole adapter), token_order/seg_starts/seg_slots int32.

Work
----
FLOPs: 2 * Ta * N * K (Ta: tokens under an adapter). With N = 3 x 16 and K = 4096 this is tiny
beside the base linear (N_base = 6144): the kernel is memory-bound.
Bytes: Ta * K * e (x) + tiles * N * K * e (A) + splits * Ta * N * 4 (h).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from rooflm.kernels.utils import check_last_dim_contiguous, dot_precision


# --------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------

@triton.jit
def _sgmv_shrink_kernel(x_ptr, a_ptr, h_ptr, order_ptr, starts_ptr, slots_ptr, tile_group_ptr, tile_row_ptr,
                        norm_w_ptr, N, K, K_PER_SPLIT, eps, stride_xm, stride_as, stride_an, stride_hs, stride_hm,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        NORM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # NORM: x is the residual stream and the linear's input is its RMSNorm (the one-token GEMV
    # chain folds the norm into the base GEMV, so no normed x exists): each program reduces its
    # rows' sum of squares over all of K (from L2), then normalises each tile with HF's casts.
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.load(tile_group_ptr + tile)
    if g >= 0:  # else: a tile past the step's (the graph's grid covers the most there can be)
        end = tl.load(starts_ptr + g + 1)
        slot = tl.load(slots_ptr + g).to(tl.int64)
        rows = tl.load(tile_row_ptr + tile) + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        tok = tl.load(order_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        x_rows = x_ptr + tok[:, None] * stride_xm
        rstd = tl.full((BLOCK_M,), 1.0, dtype=tl.float32)
        if NORM:
            sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                xf = tl.load(x_rows + offs_k[None, :], mask=row_ok[:, None] & (offs_k < K)[None, :],
                             other=0.0).to(tl.float32)
                sq += tl.sum(xf * xf, 1)
            rstd = 1.0 / tl.sqrt(sq / K + eps)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K_PER_SPLIT, BLOCK_K):
            offs_k = split * K_PER_SPLIT + k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            xt = tl.load(x_rows + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if NORM:
                nw = tl.load(norm_w_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
                xt = ((xt.to(tl.float32) * rstd[:, None]).to(xt.dtype).to(tl.float32) * nw[None, :]).to(xt.dtype)
            at = tl.load(a_ptr + slot * stride_as + offs_n[:, None] * stride_an + offs_k[None, :],
                         mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.dot(xt, tl.trans(at.to(xt.dtype)), input_precision=DOT_PRECISION)
        tl.store(h_ptr + split * stride_hs + tok[:, None] * stride_hm + offs_n[None, :], acc,
                 mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _graph_groups_kernel(token_slots_ptr, order_ptr, starts_ptr, slots_ptr, tile_group_ptr, tile_row_ptr,
                         B, S, L, BLOCK_B: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_L: tl.constexpr,
                         BLOCK_M: tl.constexpr):
    # graph_segments and slot_tiles in one program (a graph's decode step runs it once, where the
    # torch form is ~15 small launches): a one-hot [rows, slots + 2] of each row's key (its slot;
    # S: no adapter; S + 1: a lane past the batch), counts and starts by a sum and a scan over
    # it, each row's place in its group by a scan down the rows; then the tiles of 16 rows.
    t = tl.arange(0, BLOCK_B)
    t_ok = t < B
    slot = tl.load(token_slots_ptr + t, mask=t_ok, other=-1)
    key = tl.where(t_ok, tl.where(slot < 0, S, slot), S + 1)
    cols = tl.arange(0, BLOCK_S)
    onehot = (key[:, None] == cols[None, :]).to(tl.int32)
    counts = tl.sum(onehot, 0)
    starts = tl.cumsum(counts, 0) - counts
    rank = tl.sum(tl.cumsum(onehot, 0) * onehot, 1) - 1
    pos = tl.sum(onehot * starts[None, :], 1) + rank
    tl.store(order_ptr + pos, t, mask=t_ok)
    tl.store(starts_ptr + cols, starts, mask=cols <= S)
    tl.store(slots_ptr + cols, cols, mask=cols < S)
    tiles = tl.where(cols < S, (counts + BLOCK_M - 1) // BLOCK_M, 0)
    tile_end = tl.cumsum(tiles, 0)
    tl_idx = tl.arange(0, BLOCK_L)
    g = tl.sum((tile_end[None, :] <= tl_idx[:, None]).to(tl.int32), 1)
    sel = cols[None, :] == g[:, None]
    first_row = tl.sum(tl.where(sel, starts[None, :], 0), 1)
    first_tile = tl.sum(tl.where(sel, (tile_end - tiles)[None, :], 0), 1)
    row = first_row + (tl_idx - first_tile) * BLOCK_M
    l_ok = tl_idx < L
    tl.store(tile_group_ptr + tl_idx, tl.where(g < S, g, -1), mask=l_ok)
    tl.store(tile_row_ptr + tl_idx, row, mask=l_ok)


# --------------------------------------------------------------------------
# Wrapper
# --------------------------------------------------------------------------

def slots_contiguous(t: torch.Tensor) -> bool:
    """Each slot's matrix contiguous; the slot stride is free (a view into the slot pool)."""
    return t.stride(2) == 1 and t.stride(1) == t.shape[2] and t.stride(0) >= t.shape[1] * t.shape[2]


MIN_SPLIT_K = 256
DECODE_BLOCK_M = 16  # tl.dot's smallest M: decode groups hold a few tokens each


def decode_splits(num_slots: int, n: int, k: int, device: torch.device) -> int:
    """How many K splits a decode step's shrink takes: enough programs to fill the GPU twice
    over when every slot has a token, each split at least MIN_SPLIT_K long. A function of the
    shapes and the slot count only (never of the step's tokens), so a captured graph and an
    eager step of any batch take the same splits and give the same bits."""
    programs = num_slots * triton.cdiv(n, block_n_for(n))
    target = 2 * _num_sms(device)
    return max(1, min(triton.cdiv(k, MIN_SPLIT_K), target // max(programs, 1)))


def prefill_splits(num_tokens: int, num_segments: int, block_m: int, n: int, k: int, device: torch.device) -> int:
    """K splits for a prefill or mixed step (eager only, so the step's sizes may choose): a
    step of a few hundred tokens has only a few dozen M tiles, each streaming its rows' whole x,
    which leaves most of the GPU idle; split K until the tiles fill it twice over."""
    tiles = (triton.cdiv(num_tokens, block_m) + num_segments) * triton.cdiv(n, block_n_for(n))
    return max(1, min(triton.cdiv(k, MIN_SPLIT_K), 2 * _num_sms(device) // max(tiles, 1)))


def block_n_for(n: int) -> int:
    return min(64, max(16, triton.next_power_of_2(n)))


def block_m_for(max_seg_len: int, decode_only: bool) -> int:
    """Rows per program: a decode group is a few tokens (and a graph's grid must not depend on
    them); a prefill segment is read in tiles of up to 64 rows, so A is re-read less often."""
    if decode_only or max_seg_len <= 16:
        return DECODE_BLOCK_M
    return 32 if max_seg_len <= 32 else 64


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits, so the tests cover them
    return torch.cuda.get_device_properties(device).multi_processor_count


def graph_segments(token_slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's groups in the graph form, computed on the device from each row's slot
    (-1: none), with no host read, so a captured graph recomputes them on every replay:
    (token_order [T] int32: the rows grouped by slot, rows of no adapter last; seg_starts
    [num_slots + 1] int32: slot s's rows are token_order[seg_starts[s]:seg_starts[s + 1]];
    seg_slots [num_slots] int32 = 0..num_slots-1). Counting, not sorting: a stable order from
    a cumulative sum, and a scatter to distinct places (deterministic)."""
    t = token_slots.shape[0]
    device = token_slots.device
    key = torch.where(token_slots < 0, num_slots, token_slots.long())  # no adapter: after every slot
    onehot = key.unsqueeze(1) == torch.arange(num_slots + 1, device=device)  # [T, S + 1]
    counts = onehot.sum(0)
    starts = torch.cumsum(counts, 0) - counts
    rank = (torch.cumsum(onehot.int(), 0) - 1).gather(1, key.unsqueeze(1)).squeeze(1)
    order = torch.empty(t, dtype=torch.int32, device=device)
    order.scatter_(0, starts[key] + rank, torch.arange(t, dtype=torch.int32, device=device))
    seg_starts = starts.to(torch.int32)  # [S + 1]: the last is where the rows of no adapter begin
    seg_slots = torch.arange(num_slots, dtype=torch.int32, device=device)
    return order, seg_starts, seg_slots


def graph_groups(token_slots: torch.Tensor, num_slots: int, block_m: int = DECODE_BLOCK_M):
    """graph_segments and slot_tiles of a graph's decode step in one launch (the same tensors:
    token_order, seg_starts, seg_slots, (tile_group, tile_row))."""
    b = token_slots.shape[0]
    device = token_slots.device
    length = tile_table_length(b, num_slots, block_m)
    if triton.next_power_of_2(b) * triton.next_power_of_2(num_slots + 2) > GRAPH_GROUPS_MAX_TILE:
        # The one program's [rows, slots] tiles would spill: the torch form's small launches.
        order, starts, seg_slots = graph_segments(token_slots, num_slots)
        return order, starts, seg_slots, slot_tiles(starts, b, block_m)
    order = torch.empty(b, dtype=torch.int32, device=device)
    starts = torch.empty(num_slots + 1, dtype=torch.int32, device=device)
    seg_slots = torch.empty(num_slots, dtype=torch.int32, device=device)
    tile_group = torch.empty(length, dtype=torch.int32, device=device)
    tile_row = torch.empty(length, dtype=torch.int32, device=device)
    _graph_groups_kernel[(1,)](token_slots, order, starts, seg_slots, tile_group, tile_row, b, num_slots, length,
                               BLOCK_B=triton.next_power_of_2(b), BLOCK_S=triton.next_power_of_2(num_slots + 2),
                               BLOCK_L=triton.next_power_of_2(length), BLOCK_M=block_m,
                               num_warps=8 if b * (num_slots + 2) > 4096 else 4)
    return order, starts, seg_slots, (tile_group, tile_row)


GRAPH_GROUPS_MAX_TILE = 32768  # e.g. batch 1024 with 30 slots, batch 512 with 62


def tile_table_length(num_tokens: int, groups: int, block_m: int) -> int:
    """The tile table's length: what the host knows bounds the step's tiles."""
    return max(1, min(num_tokens, triton.cdiv(num_tokens, block_m) + groups))


def slot_tiles(seg_starts: torch.Tensor, num_tokens: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' M tiles, made on the device with no host read (a graph recomputes them on
    each replay): tile t covers token_order[tile_row[t]:tile_row[t] + block_m] of group
    tile_group[t] (-1: no tile; the rows past the group's end are masked). The table's length
    is what the host knows bounds it, min(tokens, ceil(tokens / block_m) + groups), so the
    launch grid has no program per (group, largest possible M block) to exit: with 16 slots at
    batch 256 that is 32 tiles, not 256."""
    groups = seg_starts.numel() - 1
    counts = (seg_starts[1:] - seg_starts[:-1]).long()
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    length = tile_table_length(num_tokens, groups, block_m)
    t = torch.arange(length, device=seg_starts.device)
    g = torch.searchsorted(tile_end, t, right=True)
    gc = g.clamp(max=groups - 1)
    rows = seg_starts.long()[gc] + (t - (tile_end - tiles)[gc]) * block_m
    tile_group = torch.where(g < groups, gc, -1).to(torch.int32)
    return tile_group, rows.to(torch.int32)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor,
                token_order: Optional[torch.Tensor], seg_starts: Optional[torch.Tensor],
                seg_slots: Optional[torch.Tensor], max_seg_len: int, decode_only: bool,
                num_splits: Optional[int] = None, norm_weight: Optional[torch.Tensor] = None,
                eps: float = 1e-6, tiles: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """Partial sums h [S, T, N] fp32 whose sum over S is x_t @ A_{slot(t)}^T, for the tokens in
    token_order (rows of other tokens are undefined: the expand never reads them). K is split
    over S programs (decode_splits, prefill_splits, or num_splits); lora_expand adds the
    partials. token_order None (a graph's decode step, decode_only): the groups are every
    slot's, from token_slots on the device (graph_segments), M blocks over the batch.
    norm_weight: x is the residual stream, the linear's input RMSNorm(norm_weight, eps)(x), as
    rooflm.kernels.gemv's NORM prologue computes it (HF's casts). tiles: slot_tiles(seg_starts,
    tokens, block_m_for(max_seg_len, decode_only)) when the caller keeps them for the step."""
    check_last_dim_contiguous("x", x)
    if lora_a.dim() != 3 or lora_a.shape[2] != x.shape[1] or not slots_contiguous(lora_a):
        raise ValueError(f"lora_a must be [slots, N, {x.shape[1]}], each slot contiguous, got "
                         f"{tuple(lora_a.shape)} with strides {lora_a.stride()}")
    t, k = x.shape
    n = lora_a.shape[1]
    if token_order is None:
        if not decode_only:
            raise ValueError("lora_shrink without token_order (every slot's group) is the decode-only form")
        token_order, seg_starts, seg_slots = graph_segments(token_slots, lora_a.shape[0])
        max_seg_len = t
    block_n = block_n_for(n)
    block_m = block_m_for(max_seg_len, decode_only)
    if num_splits:
        splits = num_splits
    elif decode_only:
        splits = decode_splits(lora_a.shape[0], n, k, x.device)
    else:
        splits = prefill_splits(token_order.numel(), seg_slots.numel(), block_m, n, k, x.device)
    k_per_split = triton.cdiv(k, splits)
    block_k = min(128, max(16, triton.next_power_of_2(k_per_split)))
    k_per_split = triton.cdiv(k_per_split, block_k) * block_k
    splits = triton.cdiv(k, k_per_split)
    # No memset: every split of every token under an adapter writes its row.
    h = torch.empty(splits, t, n, dtype=torch.float32, device=x.device)
    if token_order.numel() == 0 or seg_slots.numel() == 0 or max_seg_len == 0:
        return h
    if norm_weight is not None and norm_weight.numel() != k:
        raise ValueError(f"norm_weight must have {k} elements, got {tuple(norm_weight.shape)}")
    tile_group, tile_row = tiles if tiles is not None else slot_tiles(seg_starts, token_order.numel(), block_m)
    grid = (tile_group.numel(), triton.cdiv(n, block_n), splits)
    _sgmv_shrink_kernel[grid](x, lora_a, h, token_order, seg_starts, seg_slots, tile_group, tile_row,
                              norm_weight if norm_weight is not None else x, n, k, k_per_split, eps,
                              x.stride(0), lora_a.stride(0), lora_a.stride(1), h.stride(0), h.stride(1),
                              BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NORM=norm_weight is not None,
                              DOT_PRECISION=dot_precision(x.dtype))
    return h


# --------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------

def lora_shrink_ref(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """h [T, N] fp32: x_t @ A_{slot(t)}^T where slot(t) >= 0, zeros elsewhere."""
    h = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    for slot in token_slots.unique().tolist():
        if slot < 0:
            continue
        idx = (token_slots == slot).nonzero().flatten()
        h[idx] = x[idx].float() @ lora_a[slot].float().T
    return h


def shrink_total(h: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """lora_shrink's partial sums [S, T, N] as the whole [T, N] the reference gives: summed,
    rows of tokens without an adapter (undefined in h) zero."""
    under = (token_slots >= 0).unsqueeze(1)
    return torch.where(under, h.sum(0), torch.zeros((), dtype=h.dtype, device=h.device))
