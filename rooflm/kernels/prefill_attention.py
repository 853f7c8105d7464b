"""Prefill attention over the paged KV cache (FlashAttention-2 in Triton).

Algorithm
---------
A step's prefill queries are packed: sequence s owns query tokens
query_start_loc[s]:query_start_loc[s+1], the last query_len of its seq_lens[s]
context tokens. Query token i of the sequence sits at position
seq_len - query_len + i and attends causally to every key at a position <= its
own (and, with a sliding window W, > position - W). All of the sequence's K/V,
old (prefix-cache hit, earlier chunks) and new (this step's tokens, written
just before), is read from the paged cache through its block table, so plain
prefill, chunked prefill and prefix hits are one code path.

One program owns one tile of BLOCK_M query rows of one sequence and one KV
head. A row is a (token, query head) pair: the GROUP query heads that share
the KV head (GQA; GROUP = 1 is MHA, GROUP = H is MQA) are stacked into the
tile, so each K/V tile is loaded once for all of them. The tile holds
BLOCK_Q = BLOCK_M / GROUP_PAD tokens. The program walks the keys in tiles of
BLOCK_N, keeping for each row the running max m and sum l of the softmax
(fp32) and the unnormalised output acc (fp32):

    s   = (q k^T) * scale * log2(e)          # [BLOCK_M, BLOCK_N], never stored
    m'  = max(m, rowmax(s))
    p   = exp2(s - m'),  alpha = exp2(m - m')
    l   = alpha * l + rowsum(p)
    acc = alpha * acc + p v
    out = acc / l                             # once, at the end

so the N x N score matrix never leaves registers. The key range splits into
tiles that need no mask (every key visible to every row: the bulk of the
work) and the few at the causal diagonal or the window's lower edge that do;
the two kinds run in separate loops so the common one carries no masking.

K/V addressing: key p of a sequence lives in cache block block_table[p //
block_size], slot p % block_size. When a key tile fits inside one block
(BLOCK_N <= block_size) the whole [BLOCK_N, D] tile is one box of the cache
seen as [slots, H_kv * D], loaded by the copy engine (TMA) on Hopper;
otherwise each key's address is gathered (cp.async). Measured on the H100,
TMA is worth ~20% (see benchmarks/results/), so large cache blocks (>= 64)
are the fast configuration.

FP8 caches (layers/kv_cache.py): K/V tiles are gathered as E4M3, widened to
q's dtype for the dots, and scaled outside them (scores by each key's K
scale, softmax weights by each value's V scale), as in decode; TMA is not
used for them. Static scales ([H_kv]) are applied outside the loop, as in
decode: K's in the softmax scale, V's to the output.

Attention sinks (gpt-oss, HAS_SINKS): one logit per query head joins each row's softmax as a key
without a value: out = acc / (l + exp2(sink - m)), rescaled to max(m, sink), at the end; the
constexpr compiles none of it when off.

Varlen scheduling: the grid's first axis enumerates query tiles of all
sequences; a program finds its sequence by binary search over
query_start_loc (tile index of sequence s starts at q_start[s] // BLOCK_Q + s,
which over-counts by at most one tile per sequence; spare programs exit). The
order is reversed so the longest tiles (the last ones of a sequence) start
first. No host work depends on the data, so the launch can be graph-captured.

Shapes
------
q, out      [T, H, D]                         (q may be a strided view)
k/v cache   [num_blocks, block_size, H_kv, D]   (q's dtype, or FP8 with scales)
k/v scale   [num_blocks, block_size, H_kv] fp32 per token, or [H_kv] static (FP8 only)
block_tables [num_seqs, max_blocks] int32, seq_lens [num_seqs] int32,
query_start_loc [num_seqs + 1] int32
D in {64, 80, 96, 128, 256} (80 and 96 are padded to 128 inside the tile).

Work
----
FLOPs  = 4 * D * H * sum over query tokens of (number of visible keys)
         (2 for q k^T and 2 for p v per visible (query, key, head, dim));
         causal self-attention of S tokens: 4 * D * H * S(S+1)/2.
Bytes  >= (q + out) T * H * D * e + (k + v) 2 * sum_s(seq_len_s) * H_kv * D * e
         (e bytes per element). At S = 2048, D = 128 the FLOPs dominate by
         ~2 orders of magnitude: prefill is compute-bound, so its yardstick is
         TFLOP/s against the matrix-unit rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from rooflm.kernels.utils import (check_paged_attention_inputs, config_for_head_dim, LOG2E, dot_precision, is_interpreter,
                                  fp8_pair_views, fp8_pv, kv_tile_offsets, load_2d, load_e4m3_pairs, load_kv_scales, next_power_of_2, upcast_dots,
                                  softcap_constexpr, softcap_log2,
                                  gdc_launch_dependents, gdc_wait, pdl_supported)
from rooflm.kernels.paged_attention_ref import has_token_scales, paged_attention_ref

if TYPE_CHECKING:  # the paged-KV contract is the layers' (layers/attention.py); kernels read its fields
    from rooflm.layers.attention import AttentionMetadata

# A masked score. Finite on purpose: a row whose first tile is fully masked
# (sliding window) then gets m = -1e30 and harmless finite garbage that the
# first visible key wipes out (alpha = exp2(-1e30 - m) = 0), never NaN.
_MASKED = tl.constexpr(-1.0e30)
_SINK_LOG2E = tl.constexpr(LOG2E)  # a sink is a natural-log logit; the kernels' scores are base 2


# --------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------

@triton.jit
def _find_seq(query_start_loc_ptr, target, seq_lo, seq_hi, BLOCK_Q: tl.constexpr):
    """Largest s in [seq_lo, seq_hi) whose first tile index q_start[s] // BLOCK_Q + s <= target."""
    left = seq_lo
    right = seq_hi
    while left < right:
        mid = (left + right) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= target:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _attend_key_range(acc, l_i, m_i, q, q_pos,
                      k_base, v_base, ks_base, vs_base, k_desc, v_desc, kv_col, block_table_ptr, lo, hi, kv_end,
                      qk_scale, sliding_window, stride_cb, stride_ct, stride_sb, stride_st, offs_d, d_ok,
                      BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PAD_D: tl.constexpr,
                      MASKED: tl.constexpr, SLIDING: tl.constexpr, UPCAST: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, ABLATE: tl.constexpr,
                      FP8: tl.constexpr, PAIRS: tl.constexpr = False, HEAD_DIM: tl.constexpr = 0,
                      WARP_SPEC: tl.constexpr = False, SCALES: tl.constexpr = True,
                      SOFTCAP_LOG2: tl.constexpr = 0.0):
    """Online-softmax update of (acc, l, m) with keys lo .. hi - 1 (kv_end bounds the loads).
    SOFTCAP_LOG2 > 0: the scaled scores are soft-capped (utils.softcap_log2) before the softmax.
    PAIRS: the FP8 caches are int16 views read as byte pairs (utils.load_e4m3_pairs).
    SCALES: an FP8 cache's per-token scales are applied here (False: static, by the caller).
    WARP_SPEC: Triton's automatic warp specialisation of the loop (loads in a producer warp,
    dots and softmax in consumers), tried on the unmasked TMA loop only."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_pair = tl.arange(0, HEAD_DIM // 2) if PAIRS else offs_d
    # Unmasked tiles inside one cache block can come through the copy engine (TMA):
    # the tile is BLOCK_N consecutive rows of the cache seen as [slots, H_kv * D].
    TMA: tl.constexpr = USE_TMA and not MASKED and BLOCK_N <= BLOCK_SIZE
    WS: tl.constexpr = WARP_SPEC and TMA
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k_idx = start_n + offs_n
        kv_ok = k_idx < kv_end
        if TMA:
            block = tl.load(block_table_ptr + start_n // BLOCK_SIZE)
            row = block * BLOCK_SIZE + start_n % BLOCK_SIZE
            k = k_desc.load([row, kv_col])
        else:
            # K and V share one layout (views of one pool): one set of offsets serves both.
            # Keys past kv_end load as zeros and are masked out of the scores.
            kv_offs = kv_tile_offsets(block_table_ptr, start_n, kv_ok, stride_cb, stride_ct,
                                      BLOCK_SIZE, BLOCK_N, MASKED)
            if PAIRS:
                k = load_e4m3_pairs(k_base + kv_offs[:, None] + offs_pair[None, :], kv_ok, MASKED, BLOCK_N, HEAD_DIM)
            else:
                k = load_2d(k_base + kv_offs[:, None] + offs_d[None, :], kv_ok, d_ok, MASKED, PAD_D)
        if FP8 and not PAIRS:  # widen E4M3 to q's dtype (fp16) for the dot; the key's scale multiplies its scores
            k = k.to(q.dtype)
        elif UPCAST:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if FP8 and SCALES:
            qk = qk * load_kv_scales(ks_base, block_table_ptr, start_n, kv_ok, stride_sb, stride_st,
                                     BLOCK_SIZE, BLOCK_N, MASKED)[None, :]
        if SOFTCAP_LOG2 > 0.0:
            # Capped scores are not a scaled dot: scale and cap here; the branches below see scale 1.
            qk = softcap_log2(qk * qk_scale, SOFTCAP_LOG2)
            tile_scale = 1.0
        else:
            tile_scale = qk_scale
        if MASKED:
            visible = k_idx[None, :] <= q_pos[:, None]
            if SLIDING:
                visible = visible & ((q_pos[:, None] - k_idx[None, :]) < sliding_window)
            qk = tl.where(visible, qk * tile_scale, _MASKED)
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - m_new[:, None])
        elif SOFTCAP_LOG2 > 0.0:
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - m_new[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            if ABLATE == 1:  # timing experiment: no exp2 on the tile (wrong results)
                p = qk * qk_scale - m_new[:, None]
            else:
                p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if TMA:
            v = v_desc.load([row, kv_col])
        elif PAIRS:
            v = load_e4m3_pairs(v_base + kv_offs[:, None] + offs_pair[None, :], kv_ok, MASKED, BLOCK_N, HEAD_DIM)
        else:
            v = load_2d(v_base + kv_offs[:, None] + offs_d[None, :], kv_ok, d_ok, MASKED, PAD_D)
        if FP8 and not PAIRS:
            v = v.to(q.dtype)
        elif UPCAST:
            v = v.to(tl.float32)
        if ABLATE != 2:  # 2, timing experiment: no rescale of the accumulator (wrong results)
            acc = acc * alpha[:, None]
        if FP8 and SCALES:
            acc = fp8_pv(acc, p, v, vs_base, block_table_ptr, start_n, kv_ok, stride_sb, stride_st,
                         BLOCK_SIZE, BLOCK_N, MASKED, DOT_PRECISION)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["seq_lo", "seq_hi", "tile_lo", "num_tiles", "sliding_window"])
def _prefill_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, sinks_ptr, k_desc, v_desc,
        block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
        seq_lo, seq_hi, tile_lo, num_tiles, qk_scale, sliding_window,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_cb, stride_ct, stride_ch, stride_bt, stride_sb, stride_st,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        SLIDING: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
        FP8: tl.constexpr = False, ABLATE: tl.constexpr = 0, UNIFORM: tl.constexpr = False,
        PDL: tl.constexpr = False, PAIRS: tl.constexpr = False, WARP_SPEC: tl.constexpr = False,
        TOKEN_SCALES: tl.constexpr = True, SOFTCAP_LOG2: tl.constexpr = 0.0, HAS_SINKS: tl.constexpr = False):
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD
    if PDL:  # launched while the RoPE/KV write drains (uniform plans): wait for q and the cache
        gdc_launch_dependents()
        gdc_wait()

    # Which sequence and which of its query tiles (longest tiles first).
    target = tile_lo + (num_tiles - 1 - tl.program_id(0))
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, target, seq_lo, seq_hi, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    tile_start = q_start + (target - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if tile_start >= q_end:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - (q_end - q_start)  # position of the sequence's first query token

    # Rows of the tile: (token, query head of the group) pairs.
    offs_m = tl.arange(0, BLOCK_M)
    tok = tile_start + offs_m // GROUP_PAD
    head = kv_head * GROUP + offs_m % GROUP_PAD
    row_ok = (tok < q_end) & (offs_m % GROUP_PAD < GROUP)
    q_pos = first_pos + (tok - q_start)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    q_offs = tok.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = load_2d(q_ptr + q_offs, row_ok, d_ok, True, PAD_D)
    if UPCAST:
        q = q.to(tl.float32)
    elif FP8:  # E4M3 widens to fp16 in one instruction (to bf16 in three): the dots run in fp16
        q = q.to(tl.float16)

    # Key ranges: [lo, full_lo) masked (window edge), [full_lo, full_hi) unmasked,
    # [full_hi, hi) masked (causal diagonal). Bounds of full_* are BLOCK_N-aligned.
    pos_lo = first_pos + (tile_start - q_start)
    pos_hi = first_pos + (tl.minimum(tile_start + BLOCK_Q, q_end) - 1 - q_start)
    hi = pos_hi + 1
    full_hi = ((pos_lo + 1) // BLOCK_N) * BLOCK_N
    if SLIDING:
        lo = (tl.maximum(pos_lo - sliding_window + 1, 0) // BLOCK_N) * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(pos_hi - sliding_window + 1, 0), BLOCK_N) * BLOCK_N
        full_lo = tl.minimum(full_lo, full_hi)
    else:
        lo = 0
        full_lo = 0
    if UNIFORM:
        # Every key tile through the masked loop: which tiles a row sees unmasked depends on the
        # other rows of its query tile (the tile's first position), and the unmasked loop rounds
        # the scaled scores differently (the scale may fuse into the exp2's FMA). One loop for all
        # tiles gives a row the same sums alone (a decode), in any prefill chunk, or beside others.
        full_lo = lo
        full_hi = lo

    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_ch
    v_base = v_cache_ptr + kv_head * stride_ch
    ks_base = k_scale_ptr + kv_head  # scales: [block, slot, head], unit head stride
    vs_base = v_scale_ptr + kv_head
    STATIC: tl.constexpr = FP8 and not TOKEN_SCALES
    if STATIC:  # one scale per KV head: K's joins the softmax scale, V's scales the output
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
    kv_col = kv_head * HEAD_DIM  # column of this head in the [slots, H_kv * D] view (TMA)

    m_i = tl.full([BLOCK_M], _MASKED, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    # The three key ranges: window edge (masked), bulk (unmasked), causal diagonal (masked).
    if SLIDING:
        acc, l_i, m_i = _attend_key_range(
            acc, l_i, m_i, q, q_pos, k_base, v_base, ks_base, vs_base, k_desc, v_desc, kv_col, block_table_ptr,
            lo, full_lo, hi, qk_scale, sliding_window, stride_cb, stride_ct, stride_sb, stride_st, offs_d, d_ok,
            BLOCK_SIZE, BLOCK_N, PAD_D, True, SLIDING, UPCAST, DOT_PRECISION, USE_TMA, ABLATE, FP8, PAIRS, HEAD_DIM,
            SCALES=TOKEN_SCALES, SOFTCAP_LOG2=SOFTCAP_LOG2)
    acc, l_i, m_i = _attend_key_range(
        acc, l_i, m_i, q, q_pos, k_base, v_base, ks_base, vs_base, k_desc, v_desc, kv_col, block_table_ptr,
        full_lo, full_hi, hi, qk_scale, sliding_window, stride_cb, stride_ct, stride_sb, stride_st, offs_d, d_ok,
        BLOCK_SIZE, BLOCK_N, PAD_D, False, SLIDING, UPCAST, DOT_PRECISION, USE_TMA, ABLATE, FP8, PAIRS, HEAD_DIM,
        WARP_SPEC, SCALES=TOKEN_SCALES, SOFTCAP_LOG2=SOFTCAP_LOG2)
    acc, l_i, m_i = _attend_key_range(
        acc, l_i, m_i, q, q_pos, k_base, v_base, ks_base, vs_base, k_desc, v_desc, kv_col, block_table_ptr,
        full_hi, hi, hi, qk_scale, sliding_window, stride_cb, stride_ct, stride_sb, stride_st, offs_d, d_ok,
        BLOCK_SIZE, BLOCK_N, PAD_D, True, SLIDING, UPCAST, DOT_PRECISION, USE_TMA, ABLATE, FP8, PAIRS, HEAD_DIM,
            SCALES=TOKEN_SCALES, SOFTCAP_LOG2=SOFTCAP_LOG2)

    if STATIC:
        acc = acc * tl.load(v_scale_ptr + kv_head)
    if HAS_SINKS:  # the sink's exp2(sink - m) in the denominator, rescaled to a common max
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * _SINK_LOG2E
        m_f = tl.maximum(m_i, sink)
        alpha = tl.math.exp2(m_i - m_f)
        out = (acc * alpha[:, None]) / (l_i * alpha + tl.math.exp2(sink - m_f))[:, None]
    else:
        out = acc / l_i[:, None]
    o_offs = tok.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    if PAD_D:
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


# --------------------------------------------------------------------------
# Wrapper
# --------------------------------------------------------------------------

# Tile shapes per padded head dim on the GPU: (BLOCK_M, BLOCK_N, num_warps, num_stages).
# Chosen on the H100 by benchmarks/kernels.py --sweep (see benchmarks/results/); the
# table, not an autotuner, decides, so a run is reproducible. 4 warps with BLOCK_M = 128
# (one warpgroup, two programs per SM that overlap each other's softmax and MMAs) beat
# 8 warps by 18-26%. Key tiles through TMA want 2 stages, gathered ones 3.
PREFILL_CONFIGS_TMA = {
    64: (128, 64, 4, 3),   # not swept on the device yet
    128: (128, 64, 4, 2),  # H100, B=8 S=2048 / B=2 S=8192: 408-423 / 486-499 TFLOP/s (3 stages: 380 / 479)
    256: (64, 32, 4, 2),   # not swept on the device yet
}
PREFILL_CONFIGS_GATHER = {
    64: (128, 64, 4, 3),   # not swept on the device yet
    128: (128, 64, 4, 3),  # H100, block_size 16: 297 / 354 TFLOP/s (2 stages: 249 / 284)
    256: (64, 32, 4, 2),   # not swept on the device yet
}
# fp32 tiles are twice the bytes: smaller tiles keep them inside shared memory.
PREFILL_CONFIGS_FP32 = {
    64: (64, 32, 4, 2),
    128: (64, 32, 4, 2),
    256: (32, 32, 4, 1),
}
# Whether whole key tiles go through TMA when they can (+17-19% on the H100).
TMA_BY_DEFAULT = True
# The interpreter pays per operation, not per element: fewer, larger tiles.
_INTERPRETER_CONFIG = (64, 32, 1, 1)


def prefill_config(head_dim: int, group: int, dtype: torch.dtype = torch.bfloat16,
                   tma: bool = True) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for this head dim, GQA group and load path."""
    d_pad = max(next_power_of_2(head_dim), 16)
    if is_interpreter():
        block_m, block_n, warps, stages = _INTERPRETER_CONFIG
    else:
        if dtype == torch.float32:
            table = PREFILL_CONFIGS_FP32
        else:
            table = PREFILL_CONFIGS_TMA if tma else PREFILL_CONFIGS_GATHER
        block_m, block_n, warps, stages = config_for_head_dim(table, d_pad)
    return max(block_m, next_power_of_2(group)), block_n, warps, stages


# Decodes through the uniform path (--deterministic) fill GROUP rows of their query tile: a
# tile of 64 rows does half the MMA work of the table's 128 for the same rows, and a row is one
# m64 wgmma of one warpgroup in both, so it sums to the same bits (H100, 64 x 1280 decodes:
# 0.166 -> 0.135 ms, the decode kernel's time, rows equal: deterministic-h100-20261123).
# 16-row tiles take the older mma instruction and do not sum alike.
UNIFORM_DECODE_BLOCK_M = 64


def uniform_decode_config(config: tuple[int, int, int, int], group: int) -> tuple[int, int, int, int]:
    """The uniform path's tile for decode-only sequences: config with fewer query rows, the
    same key tiles, warps and stages (the key loop, and so every row's sums, unchanged)."""
    block_m, block_n, num_warps, num_stages = config
    return max(min(block_m, UNIFORM_DECODE_BLOCK_M), next_power_of_2(group)), block_n, num_warps, num_stages


def _tma_applies(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int) -> bool:
    head_dim, block_size = q.shape[2], k_cache.shape[1]
    return (k_cache.is_contiguous() and v_cache.is_contiguous() and head_dim == next_power_of_2(head_dim)
            and head_dim >= 16 and block_n <= block_size)


@dataclass
class PrefillPlan:
    """A step's prefill attention launch beyond the layer's tensors, worked out once per step
    (the same for every layer): the tile range, the tile table entry and the TMA choice."""

    first_seq: int
    tile_lo: int
    num_tiles: int
    config: tuple[int, int, int, int]  # BLOCK_M, BLOCK_N, num_warps, num_stages
    use_tma: bool
    sliding: bool
    uniform: bool = False  # every key tile masked: a row's sums do not depend on its tile-mates
    end_seq: Optional[int] = None  # sequences first_seq .. end_seq - 1 (None: to the last)
    # Programmatic dependent launch, for uniform plans only: --deterministic runs every
    # attention through this kernel between PDL-launched kernels (the RoPE/KV write before, the
    # persistent matmul after), so without it each layer pays two full launch gaps. The default
    # path's prefill launches sit beside decode attention in mixed steps, where early-resident
    # programs could hold SM slots the decode kernel's later waves need (utils.pdl_launch): not
    # measured, so not switched on there.
    pdl: bool = False


def plan_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, sliding_window: Optional[int] = None, *,
                           out: Optional[torch.Tensor] = None, first_seq: int = 0,
                           config: Optional[tuple[int, int, int, int]] = None,
                           use_tma: Optional[bool] = None, k_scale: Optional[torch.Tensor] = None,
                           v_scale: Optional[torch.Tensor] = None,
                           uniform: bool = False, end_seq: Optional[int] = None) -> Optional[PrefillPlan]:
    """Check the inputs and fix the launch for a step (see prefill_attention); None: no chunks.
    uniform: one code path for every key tile (batch-invariant rows: --deterministic); it
    takes gathered loads, not TMA. end_seq: attend sequences first_seq .. end_seq - 1 only."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    check_paged_attention_inputs(q, k_cache, v_cache, meta, out if out is not None else q, k_scale, v_scale)
    if k_scale is not None or uniform:
        if use_tma:
            raise ValueError("FP8 caches and uniform plans are read with gathered loads, not TMA")
        use_tma = False
    num_seqs = meta.num_seqs if end_seq is None else min(end_seq, meta.num_seqs)
    if first_seq >= num_seqs:
        return None
    group = num_heads // num_kv_heads
    # Whole key tiles through TMA where they can be (Hopper and later), else gathered
    # loads; each path has its own tile table.
    requested_tma = use_tma
    if use_tma is None:
        use_tma = TMA_BY_DEFAULT and not is_interpreter() and torch.cuda.get_device_capability(q.device)[0] >= 9
    if config is None:
        config = prefill_config(head_dim, group, q.dtype, tma=True)
        if not (use_tma and _tma_applies(q, k_cache, v_cache, config[1])):
            config = prefill_config(head_dim, group, q.dtype, tma=False)
    block_m, block_n, num_warps, num_stages = config
    if use_tma and not _tma_applies(q, k_cache, v_cache, block_n):
        if requested_tma:
            raise ValueError("use_tma needs contiguous caches, a power-of-two head dim and BLOCK_N <= block_size")
        use_tma = False
    group_pad = next_power_of_2(group)
    if block_m < group_pad or block_m % group_pad:
        raise ValueError(f"BLOCK_M {block_m} must be a multiple of the padded group {group_pad}")
    block_q = block_m // group_pad
    starts = meta.query_start_loc_cpu
    tile_lo = starts[first_seq] // block_q + first_seq
    num_tiles = starts[num_seqs] // block_q + num_seqs - tile_lo
    sliding = sliding_window is not None and sliding_window > 0
    return PrefillPlan(first_seq, tile_lo, num_tiles, config, use_tma, sliding, uniform, num_seqs,
                       pdl=uniform and pdl_supported(q.device))


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, sliding_window: Optional[int] = None,
                      *, out: Optional[torch.Tensor] = None, first_seq: int = 0,
                      config: Optional[tuple[int, int, int, int]] = None,
                      use_tma: Optional[bool] = None, _ablate: int = 0,
                      plan: Optional[PrefillPlan] = None, k_scale: Optional[torch.Tensor] = None,
                      v_scale: Optional[torch.Tensor] = None, uniform: bool = False,
                      softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
                      _warp_spec: bool = False) -> torch.Tensor:
    """Causal attention of the queries of sequences first_seq.. against their paged K/V.

    q: [T, H, D]; k_cache/v_cache: [num_blocks, block_size, H_kv, D]; the K/V of
    this step's tokens must already be in the cache. Writes the rows of those
    sequences into out (allocated when None) and returns it; other rows are
    left untouched. config = (BLOCK_M, BLOCK_N, num_warps, num_stages) overrides
    the table. use_tma (default: where it applies on a Hopper-class GPU) loads
    whole key tiles with the tensor-memory accelerator; it needs a contiguous
    cache, a power-of-two head dim and BLOCK_N <= block_size. _ablate (1: no
    exp2, 2: no accumulator rescale) is for the benchmark's what-limits-it
    experiments only: the results are wrong. plan: from plan_prefill_attention
    for this step's metadata and shapes (then first_seq, config and use_tma are its own).
    uniform: every key tile through one (masked) loop, so a query row's result does not depend
    on the rows beside it; decodes may then run through this kernel too (--deterministic).
    FP8 caches take their k_scale / v_scale [num_blocks, block_size, H_kv] fp32 (or static [H_kv]).
    softcap: scores soft-capped, cap * tanh(s / cap), before the softmax (Gemma 2).
    sinks: [H] one logit per query head in each softmax's denominator (gpt-oss).
    _warp_spec: Triton's warp specialisation of the unmasked TMA loop (a benchmark experiment).
    """
    if out is None:
        out = torch.empty_like(q)
    if plan is None:
        plan = plan_prefill_attention(q, k_cache, v_cache, meta, sliding_window, out=out, first_seq=first_seq,
                                      config=config, use_tma=use_tma, k_scale=k_scale, v_scale=v_scale,
                                      uniform=uniform)
        if plan is None:
            return out
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_blocks, block_size, num_kv_heads = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    block_m, block_n, num_warps, num_stages = plan.config
    head_dim_pad = max(next_power_of_2(head_dim), 16)
    if plan.use_tma:
        slots = num_blocks * block_size
        k_desc = TensorDescriptor(k_cache, [slots, num_kv_heads * head_dim], [num_kv_heads * head_dim, 1],
                                  [block_n, head_dim])
        v_desc = TensorDescriptor(v_cache, [slots, num_kv_heads * head_dim], [num_kv_heads * head_dim, 1],
                                  [block_n, head_dim])
    else:
        k_desc, v_desc = k_cache, v_cache  # unused

    if sinks is not None and (sinks.shape != (num_heads,) or not sinks.is_contiguous() or sinks.device != q.device):
        raise ValueError(f"sinks must be a contiguous [{num_heads}] tensor on {q.device}, got "
                         f"{tuple(sinks.shape)} on {sinks.device}")
    grid = (plan.num_tiles, num_kv_heads)
    fp8 = k_scale is not None
    token_scales = has_token_scales(k_scale)
    views = fp8_pair_views(k_cache, v_cache) if fp8 and not plan.use_tma else None
    pairs = views is not None
    if pairs:
        k_cache, v_cache = views
    _prefill_attention_kernel[grid](
        out, q, k_cache, v_cache, k_scale if fp8 else q, v_scale if fp8 else q, sinks if sinks is not None else q,
        k_desc, v_desc,
        meta.block_tables, meta.seq_lens, meta.query_start_loc,
        plan.first_seq, meta.num_seqs if plan.end_seq is None else plan.end_seq, plan.tile_lo, plan.num_tiles, scale * LOG2E,
        sliding_window if plan.sliding else 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
        k_scale.stride(0) if token_scales else 0, k_scale.stride(1) if token_scales else 0,
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        SLIDING=plan.sliding, UPCAST=upcast_dots(q.dtype), DOT_PRECISION=dot_precision(q.dtype),
        USE_TMA=plan.use_tma, FP8=fp8, ABLATE=_ablate, UNIFORM=plan.uniform, PDL=plan.pdl, PAIRS=pairs,
        WARP_SPEC=_warp_spec, TOKEN_SCALES=token_scales, SOFTCAP_LOG2=softcap_constexpr(softcap),
        HAS_SINKS=sinks is not None,
        num_warps=num_warps,
        num_stages=num_stages, **({"launch_pdl": True} if plan.pdl else {}),
    )
    return out


# --------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------

def prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float,
                          sliding_window: Optional[int] = None, k_scale: Optional[torch.Tensor] = None,
                          v_scale: Optional[torch.Tensor] = None, softcap: Optional[float] = None,
                          sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The engine core's reference: fp32 attention over K/V gathered through the block tables."""
    return paged_attention_ref(q, k_cache, v_cache, meta, scale, sliding_window, k_scale, v_scale, softcap, sinks)


def prefill_flops(meta: AttentionMetadata, num_heads: int, head_dim: int,
                  sliding_window: Optional[int] = None, first_seq: int = 0) -> int:
    """FLOPs the causal attention must do: 4 * D * H per visible (query, key) pair."""
    pairs = 0
    starts = meta.query_start_loc_cpu
    for s in range(first_seq, meta.num_seqs):
        seq_len = meta.seq_lens_cpu[s]
        query_len = starts[s + 1] - starts[s]
        pairs += visible_pairs(seq_len - query_len, seq_len, sliding_window)
    return 4 * head_dim * num_heads * pairs


def visible_pairs(first_pos: int, end_pos: int, sliding_window: Optional[int] = None) -> int:
    """sum over query positions p in [first_pos, end_pos) of min(p + 1, window)."""
    def triangle(n: int) -> int:  # 1 + 2 + ... + n
        return n * (n + 1) // 2
    w = sliding_window if sliding_window else end_pos
    # Positions whose p + 1 <= w see p + 1 keys; the rest see w.
    split = min(max(first_pos, w), end_pos)  # first position with p + 1 > w
    return (triangle(split) - triangle(first_pos)) + w * (end_pos - split)
