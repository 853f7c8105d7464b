"""The device loop's bookkeeping around a verify forward (rooflm/spec/loop.py), in Triton.

Why
---
Around each verify forward the loop builds the step's inputs from the device state and, after
it, accepts drafts and advances the state. As torch ops that is ~35 small kernels a step
(~0.12 ms of a ~6.1 ms batch-1 step on the H100); here it is two launches and torch's argmax.

Algorithm (one program per slot b, W = K + 1 rows)
---------
prepare: live_b = active_b and length_b < limit_b; drafts beyond limit_b - length_b - 1 are
  dropped (num_drafts clamped). Row j holds the last token (j = 0) or draft j - 1, at position
  length_b - 1 + j, written to slot block_table[pos // block_size] * block_size + pos % block_size;
  seq_len_b = length_b + K. A slot that is not live computes W padding rows (id 0, positions
  0..W-1, slot -1: no K/V written) with seq_len W.
accept (from target: each row's argmax, or for a sampled slot the draft where speculative
  sampling accepts it and the token drawn there where it does not): a_b = the number of leading
  drafts equal to the target of the row before them (within num_drafts); the emitted tokens are
  those drafts and target[a_b]; a live slot appends its a_b + 1 tokens to its history and advances its
  length; the pack row is [emitted (W), count, drafts (K), num_drafts].

Work
----
No FLOPs; O(B x W) loads and stores. Launch-bound: two launches a step.

Reference: SpecLoop._prepare_torch / _accept_torch (rooflm/spec/loop.py: torch ops, the CPU path,
which imports no Triton); tests/kernels/test_spec_loop_step.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rooflm.kernels.utils import next_power_of_2


@triton.jit
def _prepare_kernel(hist_ptr, lengths_ptr, limit_ptr, active_ptr, live_ptr, drafts_ptr, num_drafts_ptr,
                    block_tables_ptr, input_ids_ptr, positions_ptr, slots_ptr, seq_lens_ptr,
                    stride_h, stride_bt, max_blocks,
                    K: tl.constexpr, W: tl.constexpr, W_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    b = tl.program_id(0)
    length = tl.load(lengths_ptr + b)
    limit = tl.load(limit_ptr + b)
    live = (tl.load(active_ptr + b) != 0) & (length < limit)
    tl.store(live_ptr + b, live)
    nd = tl.minimum(tl.load(num_drafts_ptr + b), tl.maximum(limit - length - 1, 0))
    tl.store(num_drafts_ptr + b, nd)
    j = tl.arange(0, W_PAD)
    in_row = j < W
    last = tl.maximum(length - 1, 0)
    pos = last + j
    first = tl.load(hist_ptr + b.to(tl.int64) * stride_h + last).to(tl.int64)
    draft = tl.load(drafts_ptr + b * K + j - 1, mask=in_row & (j >= 1), other=0)
    ids = tl.where(j == 0, first, draft)
    block = tl.load(block_tables_ptr + b.to(tl.int64) * stride_bt + tl.minimum(pos // BLOCK_SIZE, max_blocks - 1),
                    mask=in_row, other=0).to(tl.int64)
    slot = block * BLOCK_SIZE + pos % BLOCK_SIZE
    row = b * W + j
    tl.store(input_ids_ptr + row, tl.where(live, ids, 0), mask=in_row)
    tl.store(positions_ptr + row, tl.where(live, pos, j.to(tl.int64)), mask=in_row)
    tl.store(slots_ptr + row, tl.where(live, slot, -1), mask=in_row)
    tl.store(seq_lens_ptr + b, tl.where(live, length + K, W).to(tl.int32))


@triton.jit
def _accept_kernel(target_ptr, hist_ptr, lengths_ptr, live_ptr, drafts_ptr, num_drafts_ptr, pack_ptr,
                   stride_h, hist_len, K: tl.constexpr, W: tl.constexpr, W_PAD: tl.constexpr):
    b = tl.program_id(0)
    j = tl.arange(0, W_PAD)
    in_row = j < W
    target = tl.load(target_ptr + b * W + j, mask=in_row, other=-1)
    nd = tl.load(num_drafts_ptr + b)
    draft = tl.load(drafts_ptr + b * K + j, mask=j < K, other=-2)
    agree = (draft == target) & (j < nd)
    accepted = tl.min(tl.where(agree | (j >= K), K, j), 0)  # the first draft that disagrees
    final = tl.sum(tl.where(j == accepted, target, 0), 0)
    emitted = tl.where(j < accepted, draft, final)
    count = tl.where(tl.load(live_ptr + b) != 0, accepted + 1, 0)
    length = tl.load(lengths_ptr + b)
    tl.store(hist_ptr + b.to(tl.int64) * stride_h + tl.minimum(length + j, hist_len - 1),
             emitted.to(tl.int32), mask=j < count)
    tl.store(lengths_ptr + b, length + count)
    pack = pack_ptr + b * (2 * W + 1)
    tl.store(pack + j, emitted, mask=in_row)
    tl.store(pack + W, count.to(tl.int64))
    tl.store(pack + W + 1 + j, draft, mask=j < K)
    tl.store(pack + 2 * W, nd)


def prepare_step(state, b: int) -> None:
    """Write the step's input rows for slots [0, b) (state: spec.loop.SpecLoop's buffers)."""
    k, w = state.k, state.width
    _prepare_kernel[(b,)](
        state.hist, state.lengths, state.limit, state.active, state.live, state.drafts, state.num_drafts,
        state.block_tables, state.input_ids, state.positions, state.slot_mapping, state.seq_lens,
        state.hist.stride(0), state.block_tables.stride(0), state.block_tables.shape[1],
        K=k, W=w, W_PAD=next_power_of_2(w), BLOCK_SIZE=state.block_size, num_warps=1)


def accept_step(state, b: int, target: torch.Tensor) -> None:
    """Accept slots [0, b)'s drafts against each row's target token [b, W] (the argmax, or for a
    sampled slot its acceptance decision folded in: SpecLoop._targets) and advance the state."""
    w = state.width
    _accept_kernel[(b,)](
        target, state.hist, state.lengths, state.live, state.drafts, state.num_drafts, state.pack,
        state.hist.stride(0), state.hist.shape[1], K=state.k, W=w, W_PAD=next_power_of_2(w), num_warps=1)
