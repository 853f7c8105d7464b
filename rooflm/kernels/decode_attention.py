"""Paged decode attention with split-KV ("flash-decoding") in Triton.

Algorithm
---------
Each decode sequence has one query token, at position seq_len - 1, that
attends to all seq_len keys of its context (the last window of them with a
sliding window W), read from the paged cache through the block table.

Decode does ~1 FLOP per byte of K/V, so it is bound by memory bandwidth: the
aim is to stream every K/V byte once, at full bandwidth, on every SM.

* GQA: one program owns one KV head and all GROUP query heads that share it
  (padded to at least 16 rows for tl.dot), so each K/V tile is loaded once
  for the whole group, not GROUP times.
* Split-KV: a batch of a few sequences has too few (sequence, KV head)
  programs to fill the GPU, so the context is cut into num_splits ranges and
  a third grid axis runs them in parallel. Each program runs the online
  softmax of FlashAttention over its range (fp32 max m, sum l, output acc)
  and writes its normalised partial output o_j = acc_j / l_j and its
  log-sum-exp lse_j = m_j + log2(l_j) (base 2). A small second kernel
  combines the splits of each (sequence, head):

      M = max_j lse_j,   w_j = exp2(lse_j - M),   out = sum_j w_j o_j / sum_j w_j

  With one split the first kernel writes the output itself and the second is
  skipped. The split count is a run-time argument (a new count compiles
  nothing) chosen from host-side sizes (the engine's: the model's context
  length), and every split range is computed in the kernel from the
  sequence's own length (whole key tiles each), so a fixed count is correct
  for any lengths (what CUDA graphs need). Splits past a short context's end
  write lse = -inf (weight 0) and no output, which the reduce does not read.
* FP8 caches (layers/kv_cache.py): K/V tiles are loaded as E4M3 (half the
  bytes), widened to q's dtype for the dots, and each key's scores are
  multiplied by its K scale, each value's softmax weight by its V scale
  (p v = sum_n p_n s_n v_n): dequantized K/V never exist in memory. With
  static scales (one per KV head, [H_kv]) the K scale joins the softmax
  scale and the V scale multiplies the output: the loop is bf16's with E4M3
  tiles.
* Attention sinks (gpt-oss, HAS_SINKS): one logit per query head joins each softmax as a key
  without a value, exp2(sink - m) added to the denominator once: at the end of a single-split
  program, or in the reduce (M = max(max_j lse_j, sink), the sink's weight beside the splits').
  Off, the constexpr compiles none of it.
* Block sizes 16 to 256: a key tile of BLOCK_N keys reads one block-table
  entry when BLOCK_N <= block_size, else one entry per key.

Shapes
------
q, out      [T, H, D]  (the first num_seqs sequences of the batch, one token each)
k/v cache   [num_blocks, block_size, H_kv, D]   (q's dtype, or FP8 with scales)
k/v scale   [num_blocks, block_size, H_kv] fp32 per token, or [H_kv] static (FP8 only)
partials    o [num_seqs, H, num_splits, D] fp32, lse [num_seqs, H, num_splits] fp32

Work
----
FLOPs = 4 * D * H * sum_s(visible keys of s)
Bytes = 2 * sum_s(visible keys of s) * H_kv * D * e   (K and V, read once;
        FP8: e = 1 + 4 / D with the scales)
        + q and out (2 * num_seqs * H * D * e) + partials (2 * 4 * num_seqs * H * num_splits * (D + 1))
The K/V term dominates: the yardstick is GB/s of K/V read against the
device's copy bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import triton
import triton.language as tl

import rooflm.envs as envs
from rooflm.kernels import fp8_decode_mma
from rooflm.kernels.utils import (check_paged_attention_inputs, config_for_head_dim, LOG2E, cdiv, dot_precision, fp8_pv, is_interpreter,
                                  fp8_pair_views, kv_tile_offsets, load_2d, load_e4m3_pairs, load_kv_scales, next_power_of_2, num_sms, upcast_dots,
                                  softcap_constexpr, softcap_log2,
                                  gdc_launch_dependents, gdc_wait, pdl_supported)
from rooflm.kernels.paged_attention_ref import has_token_scales, paged_attention_ref

if TYPE_CHECKING:  # the paged-KV contract is the layers' (layers/attention.py); kernels read its fields
    from rooflm.layers.attention import AttentionMetadata

_MASKED = tl.constexpr(-1.0e30)
_SINK_LOG2E = tl.constexpr(LOG2E)  # a sink is a natural-log logit; the kernels' scores are base 2
# A key tile that fills a whole cache block (BLOCK_N == block size, e.g. 128 and 128) has its offsets
# from one block-table entry only with one split (kv_tile_offsets' ONE_ENTRY_AT_EQUAL), key by key
# otherwise. Compiled for sm_90 the one-entry form holds 254 registers (2 CTAs an SM) against 131
# (3): it streams a long key range faster (64 x 1024/256 TPOT 9.70 -> 9.58 ms on the H100) but, as
# the short split ranges of a small batch inside the PDL-chained batch-1 layer, it cost batch-1 TPOT
# 5.69 -> 5.77 ms (benchmarks/results/fa4-prefill-h100-20261126/one-entry/).
# ROOFLM_DECODE_ONE_ENTRY=1|0 forces one form (benchmarks/one_entry_ab.sh).


# --------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------

@triton.jit
def _decode_key_range(acc, l_i, m_i, q, k_base, v_base, ks_base, vs_base, block_table_ptr, lo, hi, kv_lo, kv_hi,
                      qk_scale, stride_cb, stride_ct, stride_sb, stride_st, offs_d, d_ok,
                      BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PAD_D: tl.constexpr,
                      MASKED: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
                      FP8: tl.constexpr, ABLATE: tl.constexpr, PAIRS: tl.constexpr = False,
                      HEAD_DIM: tl.constexpr = 0, ONE_ENTRY: tl.constexpr = True, SCALES: tl.constexpr = True,
                      SOFTCAP_LOG2: tl.constexpr = 0.0):
    """Online-softmax update with the key tiles lo .. hi; keys outside [kv_lo, kv_hi) are masked.
    PAIRS: the FP8 caches are int16 views (strides in byte pairs), widened a pair at a time.
    SCALES: an FP8 cache's per-token scales are applied here (False: static scales, applied by
    the caller outside the loop)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_pair = tl.arange(0, HEAD_DIM // 2) if PAIRS else offs_d
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k_idx = start_n + offs_n
        kv_ok = (k_idx >= kv_lo) & (k_idx < kv_hi)
        kv_offs = kv_tile_offsets(block_table_ptr, start_n, kv_ok, stride_cb, stride_ct,
                                  BLOCK_SIZE, BLOCK_N, MASKED, ONE_ENTRY)
        if PAIRS:
            k = load_e4m3_pairs(k_base + kv_offs[:, None] + offs_pair[None, :], kv_ok, MASKED, BLOCK_N, HEAD_DIM)
            v = load_e4m3_pairs(v_base + kv_offs[:, None] + offs_pair[None, :], kv_ok, MASKED, BLOCK_N, HEAD_DIM)
        else:
            k = load_2d(k_base + kv_offs[:, None] + offs_d[None, :], kv_ok, d_ok, MASKED, PAD_D)
            v = load_2d(v_base + kv_offs[:, None] + offs_d[None, :], kv_ok, d_ok, MASKED, PAD_D)
        if FP8 and not PAIRS:  # widen E4M3 to q's dtype (fp16 on the GPU) for the dots; scales applied outside them
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        elif UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if FP8 and SCALES and ABLATE != 1:  # ABLATE 1 (timing experiment, wrong results): no scales at all
            qk = qk * load_kv_scales(ks_base, block_table_ptr, start_n, kv_ok, stride_sb, stride_st,
                                     BLOCK_SIZE, BLOCK_N, MASKED)[None, :]
        if SOFTCAP_LOG2 > 0.0:
            qk = softcap_log2(qk, SOFTCAP_LOG2)
        if MASKED:
            qk = tl.where(kv_ok[None, :], qk, _MASKED)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if FP8 and SCALES and ABLATE == 0:
            acc = fp8_pv(acc, p, v, vs_base, block_table_ptr, start_n, kv_ok, stride_sb, stride_st,
                          BLOCK_SIZE, BLOCK_N, MASKED, DOT_PRECISION)
        elif FP8 and SCALES and ABLATE == 2:  # timing experiment: V scales folded into p, no normalisation
            vs = load_kv_scales(vs_base, block_table_ptr, start_n, kv_ok, stride_sb, stride_st,
                                BLOCK_SIZE, BLOCK_N, MASKED)
            acc = tl.dot((p * vs[None, :]).to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["sliding_window", "num_splits"])
def _decode_attention_kernel(
        out_ptr, part_out_ptr, part_lse_ptr, q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, sinks_ptr,
        block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, qk_scale, sliding_window, num_splits,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ct, stride_ch, stride_bt,
        stride_sb, stride_st,
        NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
        SINGLE_SPLIT: tl.constexpr, SLIDING: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
        FP8: tl.constexpr, PDL: tl.constexpr, ABLATE: tl.constexpr = 0, PAIRS: tl.constexpr = False,
        ONE_ENTRY: tl.constexpr = True, TOKEN_SCALES: tl.constexpr = True, SOFTCAP_LOG2: tl.constexpr = 0.0,
        HAS_SINKS: tl.constexpr = False):
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD
    if PDL:  # launched early (programmatic dependent launch): wait for q and the K/V writes
        gdc_launch_dependents()
        gdc_wait()
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    tok = tl.load(query_start_loc_ptr + seq).to(tl.int64)

    # The group's query heads, padded to ROWS >= 16 rows for tl.dot.
    offs_g = tl.arange(0, ROWS)
    g_ok = offs_g < GROUP
    head = kv_head * GROUP + offs_g
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    q = load_2d(q_ptr + tok * stride_qt + head[:, None] * stride_qh + offs_d[None, :], g_ok, d_ok, True, PAD_D)
    if UPCAST:
        q = q.to(tl.float32)
    elif FP8:  # E4M3 widens to fp16 in one instruction (to bf16 in three): the dots run in fp16
        q = q.to(tl.float16)

    # This split's keys: [start, end), of the visible keys [kv_lo, seq_len).
    if SLIDING:
        kv_lo = tl.maximum(seq_len - sliding_window, 0)
    else:
        kv_lo = 0
    first_tile = (kv_lo // BLOCK_N) * BLOCK_N
    per_split = tl.cdiv(tl.cdiv(seq_len - first_tile, num_splits), BLOCK_N) * BLOCK_N
    start = first_tile + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_ch
    v_base = v_cache_ptr + kv_head * stride_ch
    ks_base = k_scale_ptr + kv_head  # scales: [block, slot, head], unit head stride
    vs_base = v_scale_ptr + kv_head
    STATIC: tl.constexpr = FP8 and not TOKEN_SCALES
    if STATIC:  # one scale per KV head: K's joins the softmax scale, V's scales the output
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
    m_i = tl.full([ROWS], _MASKED, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM_PAD], dtype=tl.float32)
    if SLIDING:
        # The window's lower edge can fall anywhere: mask every tile.
        acc, l_i, m_i = _decode_key_range(acc, l_i, m_i, q, k_base, v_base, ks_base, vs_base, block_table_ptr,
                                          start, end, kv_lo, end, qk_scale, stride_cb, stride_ct,
                                          stride_sb, stride_st, offs_d, d_ok,
                                          BLOCK_SIZE, BLOCK_N, PAD_D, True, UPCAST, DOT_PRECISION, FP8, ABLATE,
                                          PAIRS, HEAD_DIM, ONE_ENTRY, TOKEN_SCALES, SOFTCAP_LOG2)
    else:
        # Whole tiles unmasked, then the ragged tail.
        full_end = tl.maximum(start + ((end - start) // BLOCK_N) * BLOCK_N, start)
        acc, l_i, m_i = _decode_key_range(acc, l_i, m_i, q, k_base, v_base, ks_base, vs_base, block_table_ptr,
                                          start, full_end, 0, end, qk_scale, stride_cb, stride_ct,
                                          stride_sb, stride_st, offs_d, d_ok,
                                          BLOCK_SIZE, BLOCK_N, PAD_D, False, UPCAST, DOT_PRECISION, FP8, ABLATE,
                                          PAIRS, HEAD_DIM, ONE_ENTRY, TOKEN_SCALES, SOFTCAP_LOG2)
        acc, l_i, m_i = _decode_key_range(acc, l_i, m_i, q, k_base, v_base, ks_base, vs_base, block_table_ptr,
                                          full_end, end, 0, end, qk_scale, stride_cb, stride_ct,
                                          stride_sb, stride_st, offs_d, d_ok,
                                          BLOCK_SIZE, BLOCK_N, PAD_D, True, UPCAST, DOT_PRECISION, FP8, ABLATE,
                                          PAIRS, HEAD_DIM, ONE_ENTRY, TOKEN_SCALES, SOFTCAP_LOG2)

    if STATIC:
        acc = acc * tl.load(v_scale_ptr + kv_head)
    if SINGLE_SPLIT:
        if HAS_SINKS:  # the sink's exp2(sink - m) in the denominator, rescaled to a common max
            sink = tl.load(sinks_ptr + head, mask=g_ok, other=0.0).to(tl.float32) * _SINK_LOG2E
            m_f = tl.maximum(m_i, sink)
            alpha = tl.math.exp2(m_i - m_f)
            out = (acc * alpha[:, None]) / (l_i * alpha + tl.math.exp2(sink - m_f))[:, None]
        else:
            out = acc / l_i[:, None]
        o_ptrs = out_ptr + tok * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    else:
        # An empty split (short sequence) has l = 0: it writes lse = -inf (weight 0) and no output,
        # which the reduce does not read.
        has_keys = l_i > 0.0
        out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        lse = tl.where(has_keys, m_i + tl.math.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        row = (seq * NUM_HEADS + head).to(tl.int64) * num_splits + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM_PAD + offs_d[None, :], out,
                 mask=(g_ok & has_keys)[:, None])
        tl.store(part_lse_ptr + row, lse, mask=g_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(out_ptr, part_out_ptr, part_lse_ptr, query_start_loc_ptr, sinks_ptr, stride_ot, stride_oh,
                          num_splits, NUM_HEADS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                          HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PDL: tl.constexpr,
                          HAS_SINKS: tl.constexpr = False):
    """Combine the num_splits partial outputs of one (sequence, head) (and its sink's weight)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tok = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_PAD)
    s_ok = offs_s < num_splits
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    row = (seq * NUM_HEADS + head).to(tl.int64) * num_splits + offs_s
    lse = tl.load(part_lse_ptr + row, mask=s_ok, other=float("-inf"))
    filled = s_ok & (lse > float("-inf"))  # empty splits wrote no output
    o = tl.load(part_out_ptr + row[:, None] * HEAD_DIM_PAD + offs_d[None, :], mask=filled[:, None], other=0.0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * _SINK_LOG2E
        m = tl.maximum(tl.max(lse, 0), sink)
        w = tl.math.exp2(lse - m)
        out = tl.sum(w[:, None] * o, 0) / (tl.sum(w, 0) + tl.math.exp2(sink - m))
    else:
        w = tl.math.exp2(lse - tl.max(lse, 0))  # split 0 always has keys, so the max is finite
        out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


# --------------------------------------------------------------------------
# Wrapper
# --------------------------------------------------------------------------

# (BLOCK_N, num_warps, num_stages) per padded head dim on the GPU, chosen on the
# H100 by benchmarks/kernels.py --sweep; a table, not an autotuner, decides.
# Long key ranges per program (big batches, no split) stream best in large tiles;
# short ranges (one long sequence cut into many splits) in small ones.
DECODE_CONFIGS = {
    64: (128, 4, 3),   # not swept on the device yet
    128: (128, 4, 3),  # H100, 32 x 4096, one split: 2963 GB/s (64-key tiles: 2878)
    256: (64, 4, 3),   # not swept on the device yet
}
DECODE_CONFIGS_SHORT = {
    64: (32, 4, 3),
    128: (32, 4, 3),   # H100, 1 x 8192 in 64 splits: 1799 GB/s (64-key tiles: 1675)
    256: (32, 4, 3),
}
# FP8 caches over long key ranges: tiles of half the bytes want fewer registers a CTA (more CTAs,
# so more tiles in flight an SM). H100 sweep of 2026-11-26 (benchmarks/kv_fp8.py, one split):
# 300 x 1500 keys 485 -> 450 us (1,959 -> 2,113 GB/s), 512 x 330 235 -> 214 us against (128, 4, 3).
DECODE_CONFIGS_FP8 = {
    64: (128, 4, 3),   # not swept on the device yet
    128: (64, 2, 6),
    256: (64, 4, 3),   # not swept on the device yet
}
# Static FP8 scales (no per-key scale work) take the same table: on the H100 at block 64 their
# (64, 2, 6) streamed 300 x 1500 in 371.7 us, (32, 2, 8) 366.8, (128, 4, 3) 383.9
# (results/kv-fp8-static-h100-20261126/). Candidate, compiled on the CPU and not yet timed:
# (128, 4, 3, 168), registers capped so that 3 CTAs fit an SM (171 uncapped on sm_90: 2).
SHORT_RANGE_TOKENS = 512  # keys per program below which the short table applies
DECODE_CONFIG_FP32 = (32, 4, 2)
_INTERPRETER_CONFIG = (32, 1, 1)
# A batch with at least SPLIT_BELOW_PROGRAMS_PER_SM * num_sms (sequence, KV head)
# programs is not split (a second pass costs more than it balances: 32 x 4096 ran at
# 2963 GB/s unsplit, 2692 in 2 splits). Smaller ones are split into about
# PROGRAMS_PER_SM * num_sms programs, each of at least MIN_SPLIT_TOKENS keys
# (1 x 8192: 16 / 32 / 64 / 128 splits gave 1195 / 1607 / 1799 / 1637 GB/s).
# Measured and not taken (attention-hopper-h100-20261126, H100): 128 splits for spans over
# 64k keys lift the kernel at 1 x 131072 from 2674 to 2839 GB/s, but the engine's count
# follows the model's context length, not the sequence's, and at a 131072-token limit it
# cost batch-1 TPOT +2.5% at 1k keys and +1.2% at 16k. Giving each sequence only
# ceil(keys / 128) of the splits cost batch-1 decode 5.46 -> 5.56 ms: a short context wants
# its few tiles spread over many programs. And the split kernel combining its own splits
# (the last program of a sequence and KV head to finish, by atomic counter, no reduce launch):
# 1 x 8192 19.1 -> 34.3 us, batch-1 TPOT 5.46 -> 5.63 ms (its combine tile's registers and the
# last program's serial tail cost more than the launch it saves, which PDL already hides).
SPLIT_BELOW_PROGRAMS_PER_SM = 1
PROGRAMS_PER_SM = 4
MIN_SPLIT_TOKENS = 128
MAX_SPLITS = 64


def decode_config(head_dim: int, dtype: torch.dtype = torch.bfloat16,
                  keys_per_program: int = 1 << 30, fp8: bool = False) -> tuple[int, ...]:
    """(BLOCK_N, num_warps, num_stages[, maxnreg]) for q's dtype; fp8: an FP8 cache."""
    if is_interpreter():
        return _INTERPRETER_CONFIG
    if dtype == torch.float32:
        return DECODE_CONFIG_FP32
    if keys_per_program < SHORT_RANGE_TOKENS:
        table = DECODE_CONFIGS_SHORT
    else:
        table = DECODE_CONFIGS_FP8 if fp8 else DECODE_CONFIGS
    return config_for_head_dim(table, max(next_power_of_2(head_dim), 16))


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int,
                      sliding_window: Optional[int] = None) -> int:
    """How many KV splits fill the GPU for this batch (host-side sizes only)."""
    span = min(max_seq_len, sliding_window) if sliding_window else max_seq_len
    programs = max(num_seqs * num_kv_heads, 1)
    if programs >= SPLIT_BELOW_PROGRAMS_PER_SM * num_sms():
        return 1
    want = cdiv(PROGRAMS_PER_SM * num_sms(), programs)
    return max(1, min(want, cdiv(span, MIN_SPLIT_TOKENS), MAX_SPLITS))


@dataclass
class DecodePlan:
    """What a step's decode attention launch needs beyond the layer's tensors: the same for
    every layer of the step, so it is worked out once (FlashInfer's plan/run split) and the
    32 launches of an 8B step skip the checks, the split and tile choice and the allocations."""

    num_seqs: int
    num_splits: int
    config: tuple[int, ...]  # BLOCK_N, num_warps, num_stages[, maxnreg]
    sliding: bool
    part_out: torch.Tensor  # [num_seqs, H, splits, D_pad] fp32 partial outputs (split-KV)
    part_lse: torch.Tensor
    pdl: bool
    mma: bool = False  # static FP8 on fp8_decode_mma.py's CUDA kernel (else the Triton kernel)


def plan_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, sliding_window: Optional[int] = None, *,
                          out: Optional[torch.Tensor] = None, num_seqs: Optional[int] = None,
                          num_splits: Optional[int] = None,
                          config: Optional[tuple[int, ...]] = None,
                          k_scale: Optional[torch.Tensor] = None,
                          v_scale: Optional[torch.Tensor] = None,
                          mma: Optional[bool] = None) -> Optional[DecodePlan]:
    """Check the inputs and fix the launch for a step (see decode_attention); None: no decodes.
    mma: whether static FP8 runs on fp8_decode_mma.py's CUDA kernel where it can; None: with one
    split only (split ranges are short, and there the Triton kernel was faster on the H100: 1 x 8192
    in 64 splits 86 against 53 us; one split: 300 x 1500 345 against 370 us, 512 x 330 147 against
    185, benchmarks/results/kv-fp8-mma-h100-20261127)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    check_paged_attention_inputs(q, k_cache, v_cache, meta, out if out is not None else q, k_scale, v_scale)
    num_seqs = meta.num_decodes if num_seqs is None else num_seqs
    if num_seqs == 0:
        return None
    starts = meta.query_start_loc_cpu
    if starts[num_seqs] - starts[0] != num_seqs:
        raise ValueError(f"decode needs one query token per sequence for the first {num_seqs} sequences")
    sliding = sliding_window is not None and sliding_window > 0
    max_len = max(meta.seq_lens_cpu[:num_seqs])
    span = min(max_len, sliding_window) if sliding else max_len
    if num_splits is None:
        num_splits = decode_num_splits(num_seqs, num_kv_heads, max_len, sliding_window if sliding else None)
    config = config or decode_config(head_dim, q.dtype, cdiv(span, num_splits), fp8=k_scale is not None)
    head_dim_pad = max(next_power_of_2(head_dim), 16)
    if num_splits > 1:
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim_pad, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = q  # unused
    mma = (num_splits == 1 if mma is None else mma) and fp8_decode_mma.supported(q, k_cache, v_cache, k_scale, sliding)
    return DecodePlan(num_seqs, num_splits, config, sliding, part_out, part_lse, pdl_supported(q.device), mma)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float, sliding_window: Optional[int] = None,
                     *, out: Optional[torch.Tensor] = None, num_seqs: Optional[int] = None,
                     num_splits: Optional[int] = None,
                     config: Optional[tuple[int, ...]] = None,
                     plan: Optional[DecodePlan] = None, k_scale: Optional[torch.Tensor] = None,
                     v_scale: Optional[torch.Tensor] = None, softcap: Optional[float] = None,
                     sinks: Optional[torch.Tensor] = None,
                     _ablate: int = 0, _mma: Optional[bool] = None, _mma_config=None) -> torch.Tensor:
    """Attention of the one query token of each of the first num_seqs sequences.

    num_seqs defaults to meta.num_decodes; those sequences must have exactly one
    query token each. Writes their rows of out (allocated when None) and
    returns it. num_splits (default: decode_num_splits) may be fixed by the
    caller, e.g. for CUDA-graph capture; config = (BLOCK_N, num_warps,
    num_stages[, maxnreg]) overrides the table. plan: from plan_decode_attention for this
    step's metadata and shapes (then num_seqs, num_splits and config are its own). FP8 caches
    take their k_scale / v_scale [num_blocks, block_size, H_kv] fp32 (or static [H_kv]). _ablate (FP8 only; 1: no
    scales, 2: V scales folded into p) is for the benchmark's what-limits-it experiments: wrong
    or less accurate results. softcap: scores soft-capped, cap * tanh(s / cap), before the softmax
    (Gemma 2; the Triton kernel only). sinks: [H] one logit per query head in each softmax's
    denominator (gpt-oss; the Triton kernel only). Static FP8 runs on fp8_decode_mma.py's CUDA kernel where it takes the
    call (plan.mma: one split by default); _mma=False forces the Triton kernel, _mma=True the CUDA one
    wherever it can run (also split), and _mma_config sets its Fp8DecodeConfig (the benchmarks' A/B).
    """
    if out is None:
        out = torch.empty_like(q)
    if plan is None:
        plan = plan_decode_attention(q, k_cache, v_cache, meta, sliding_window, out=out, num_seqs=num_seqs,
                                     num_splits=num_splits, config=config, k_scale=k_scale, v_scale=v_scale,
                                     mma=_mma)
        if plan is None:
            return out
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    head_dim_pad = max(next_power_of_2(head_dim), 16)
    group = num_heads // num_kv_heads
    block_n, num_warps, num_stages = plan.config[:3]
    # A 4th entry caps the registers a thread (ptxas .maxnreg): one CTA more an SM where the
    # compiler lands just over a multiple (static FP8 at (128, 4, 3): 171 -> 168, 2 -> 3 CTAs;
    # the sweeps' candidate, not in the tables).
    launch_kwargs = {"maxnreg": plan.config[3]} if len(plan.config) > 3 and not is_interpreter() else {}
    num_seqs, num_splits, pdl = plan.num_seqs, plan.num_splits, plan.pdl
    pdl_kwargs = {"launch_pdl": True} if pdl else {}
    fp8 = k_scale is not None
    token_scales = has_token_scales(k_scale)
    if sinks is not None:
        _check_sinks(sinks, num_heads, q.device)
    if plan.mma and _mma is not False and softcap is None and sinks is None:
        fp8_decode_mma.fp8_decode_attention_mma(
            out, q, k_cache, v_cache, k_scale, v_scale, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            scale * LOG2E, num_seqs, num_splits, plan.part_out, plan.part_lse, pdl,
            **({"config": _mma_config} if _mma_config is not None else {}))
    else:
        views = fp8_pair_views(k_cache, v_cache) if fp8 else None
        pairs = views is not None
        if pairs:
            k_cache, v_cache = views
        _decode_attention_kernel[(num_seqs, num_kv_heads, num_splits)](
            out, plan.part_out, plan.part_lse, q, k_cache, v_cache,
            k_scale if fp8 else q, v_scale if fp8 else q, sinks if sinks is not None else q,
            meta.block_tables, meta.seq_lens, meta.query_start_loc, scale * LOG2E,
            sliding_window if plan.sliding else 0, num_splits,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
            k_scale.stride(0) if token_scales else 0, k_scale.stride(1) if token_scales else 0,
            NUM_HEADS=num_heads, GROUP=group, ROWS=max(16, next_power_of_2(group)),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size, BLOCK_N=block_n,
            SINGLE_SPLIT=num_splits == 1, SLIDING=plan.sliding, UPCAST=upcast_dots(q.dtype),
            DOT_PRECISION=dot_precision(q.dtype), FP8=fp8, PDL=pdl, ABLATE=_ablate, PAIRS=pairs,
            ONE_ENTRY=num_splits == 1 if envs.cached.ROOFLM_DECODE_ONE_ENTRY == "auto" else envs.cached.ROOFLM_DECODE_ONE_ENTRY != "0", TOKEN_SCALES=token_scales,
            SOFTCAP_LOG2=softcap_constexpr(softcap), HAS_SINKS=sinks is not None,
            num_warps=num_warps,
            num_stages=num_stages,
            **pdl_kwargs, **launch_kwargs,
        )
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, plan.part_out, plan.part_lse, meta.query_start_loc, sinks if sinks is not None else out,
            out.stride(0), out.stride(1), num_splits,
            NUM_HEADS=num_heads, SPLITS_PAD=next_power_of_2(num_splits),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, PDL=pdl, HAS_SINKS=sinks is not None,
            num_warps=4 if head_dim_pad >= 128 else 2,
            **pdl_kwargs,
        )
    return out


def _check_sinks(sinks: torch.Tensor, num_heads: int, device: torch.device) -> None:
    if sinks.shape != (num_heads,) or not sinks.is_contiguous() or sinks.device != device:
        raise ValueError(f"sinks must be a contiguous [{num_heads}] tensor on {device}, got "
                         f"{tuple(sinks.shape)} on {sinks.device}")


# --------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------

def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: AttentionMetadata, scale: float,
                         sliding_window: Optional[int] = None, k_scale: Optional[torch.Tensor] = None,
                         v_scale: Optional[torch.Tensor] = None, softcap: Optional[float] = None,
                         sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The engine core's reference: fp32 attention over K/V gathered through the block tables."""
    return paged_attention_ref(q, k_cache, v_cache, meta, scale, sliding_window, k_scale, v_scale, softcap, sinks)


def decode_kv_bytes(meta: AttentionMetadata, num_kv_heads: int, head_dim: int, elem_bytes: int,
                    sliding_window: Optional[int] = None, num_seqs: Optional[int] = None) -> int:
    """Bytes of K and V the decode must read: every visible key once."""
    num_seqs = meta.num_decodes if num_seqs is None else num_seqs
    keys = sum(min(n, sliding_window) if sliding_window else n for n in meta.seq_lens_cpu[:num_seqs])
    return 2 * keys * num_kv_heads * head_dim * elem_bytes
