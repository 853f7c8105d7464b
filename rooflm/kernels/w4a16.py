"""W4A16: y = x @ W.T with W in 4-bit groups, dequantized as it is loaded, in Triton.

Why
---
Decode at small batch is weight-bandwidth-bound: every step streams every weight once. Four-bit
codes with one (scale, zero) pair per group of g weights read 4 + 32 * 2 / g bits a weight
(4.25 at g = 128) instead of bf16's 16, so the floor of a decode step drops ~3.8x. The weight is
never materialised in float: each tile is unpacked in registers just before the multiply (the
AWQ/GPTQ/Marlin idea; this kernel is the plain Triton version of it).

Layout (rooflm's runtime packing, made from AWQ/GPTQ/RTN weights by rooflm/quant/formats.py)
------
  qweight  uint8 [N, S]       S = int4_split(K, g) = K / 2 rounded up to whole groups; byte j of
                              row n holds code k = j in the low nibble and k = S + j in the high
                              one. A tile of BLOCK_K / 2 bytes is two K ranges of whole groups,
                              one per nibble: one mask each, no interleave to undo (the old
                              even/odd packing needed join + reshape: layout conversions).
  scales   [K / g, N]         float (the activation dtype), one per group and output row;
  zeros    [K / g, N]         float zero points in code units; group-major so that the BLOCK_N
                              values a group needs are one contiguous load.
  w[n, k] = (code[n, k] - zeros[k // g, n]) * scales[k // g, n]

Algorithm
---------
M <= 8 on a CUDA GPU with NVRTC: w4a16_linear hands the call to the hand-written mma.sync kernel
(w4a16_mma.py, csrc/w4a16_mma.cu; the same layout), 1.2-1.9x faster than the Triton tiles below on the
H100's 8B shapes (benchmarks/results/quant-w4-mma-h100-20261127). The Triton kernels serve M > 8,
fp32 x, padded groups, the CPU interpreter and a machine without NVRTC.

Each program owns BLOCK_N output columns (rows of W), BLOCK_M rows of x, and one of SPLIT_K
ranges of the packed bytes (split-K: more programs for narrow N). It walks its range BLOCK_K / 2
bytes at a time, one group at a time:
  - codes to fp32 without an int->float convert (those run on the SM's slow conversion pipe):
    a code shifted into the top mantissa bits of 1.0 (0x3F800000) reads as w' = 1 + code / 16,
    exact; (code - zero) = 16 (w' - (1 + zero / 16)), the subtract exact (both in [1, 2)) and
    1 + zero / 16 a per-row constant of the group. A weight costs a shift and an and-or, one
    subtract and one multiply-add; no float op converts it.
  - M == 1 (GEMV, CUDA cores): (code - z) s = w' (16 s) - s (16 + z), one FMA with per-row
    constants of the group, and one FMA into an elementwise [BLOCK_N, g] accumulator reduced once
    at the end: 2 float ops a weight (tl.fma spelled out; left to the compiler, (a + b c) + d e
    fused only in part). Both nibbles of a byte land in the same accumulator tile (fold=False).
    The loop is a tl.range with num_stages: Triton pipelines every load of it (bytes, x, scales)
    through cp.async, which the kernel-level num_stages does only for loads that feed tl.dot;
    a GEMV stream is latency-bound without it.
  - M == 1 with fold=True (_gemv_folded): each thread sums its 16 codes of a row against x
    unscaled (one FMA a weight) and applies the scale and zero once per 16: ~25% fewer
    instructions and half the registers, yet slower on the H100's 8B shapes (its warps stall
    longer and L2 is busier: benchmarks/results/quant-w4-fold-h100-20261127). A sweep candidate,
    not the heuristic's choice.
  - x_sums (fold): the groups' sums of x from one small launch (x_group_sums) instead of in every
    program; at M = 64 the swapped tiles' row sums cost about as much as the unpacking.
  - M > 1 (GEMM, tensor cores; also a candidate at M == 1 with the row padded to 16, Marlin's
    choice): w' = 1 + code / 16 is built by bits directly in the activation dtype (exact in
    bf16/fp16: four mantissa bits) and multiplied as it is, the scale and zero applied per group
    to the [BLOCK_M, BLOCK_N] results: 16 s (x @ w'.T) - s (16 + z) (x @ ones). No float op
    touches a weight; sum(x) comes from a dot with ones so it lands in the accumulator's layout.
    (fold=False: the per-weight dequant (w' - (1 + z / 16)) 16 s rounded to the dtype, for the sweep.)
  - swap_ab (M > 1): the [BLOCK_N, BLOCK_M] tile of y.T = W @ x.T, as CUTLASS's mixed-input Hopper
    GEMMs and Machete do at small M. Hopper's wgmma reads its A operand from registers, B only from
    shared memory: the unpacked W as A goes straight to the tensor cores (as B it goes back through
    shared memory, or the dot falls back to mma.sync), x.T is B. BLOCK_N is wgmma's M (64 a
    warpgroup), BLOCK_M its N (16..64). The fold takes sum(x) as a row sum (fp32), not a second MMA.

  - split-K: each program stores its fp32 partial in a workspace [SPLIT_K, M, N]; the last of an
    output tile's SPLIT_K programs to finish (one atomic counter per tile, rooflm/kernels/split_k.py
    tile_counters) reads the partials back, adds them in order of split (from 0, as split_k_reduce
    does: the same bits) and writes y. One launch a linear, not two (the separate sum was 0.2 ms
    of a batch-16 decode step on the H100, besides its launch gaps; matmul_fixed_split.py's
    "programs" schedule does the same). ROOFLM_W4_FUSED_REDUCE=0: the two launches.
  - PDL (sm_90+): x is the only input a kernel before writes; the loop waits for it (gdc_wait), and
    each program releases the next kernel (gdc_launch_dependents) at its end: at the start or
    after the main loop was slower (utils.pdl_launch; the end of the tensor-core path).

Work
----
FLOPs 2 M N K. Bytes N S (codes) + 2 * 2 N K / g (scales, zeros) + 2 M K (x) + 2 M N (y).
At M <= 64 on an H100 the weight bytes dominate: the bound is bytes / ~3.0 TB/s. Split-K adds
8 SPLIT_K M N bytes of workspace (written, read back from L2) and a 4-byte counter a tile.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

import rooflm.envs as envs
from rooflm.kernels import w4a16_mma
from rooflm.kernels.split_k import split_for, split_k_reduce, tile_counters
from rooflm.kernels.tuned_configs import device_facts, lookup
from rooflm.kernels.utils import gdc_launch_dependents, gdc_wait, is_interpreter, pdl_launch, pdl_supported
from rooflm.kernels.int4_pack import int4_split, pack_int4, unpack_int4

__all__ = ["W4Config", "pick_config", "w4a16_linear", "w4a16_linear_ref", "dequantize_w4", "w4a16_bytes",
           "pack_int4", "unpack_int4", "int4_split"]

# The bits of 1.0f and the place of a code in them: (code << 19) | ONE_BITS reads as 1 + code / 16.
ONE_BITS = tl.constexpr(0x3F800000)
CODE_BITS = tl.constexpr(0x00780000)


# --------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------

@triton.jit
def _unit_nibbles(p):
    """uint8 bytes -> w' = (1 + low code / 16, 1 + high code / 16) in fp32, exact: a code shifted
    into the top four mantissa bits of 1.0 (0x3F800000). Integer ops only (shift, and-or): no
    int->float convert (the SM's slow conversion pipe) and no float op. (Placing the code at
    bits 16..19 instead, a byte move, was tried: ptxas still shifts; no fewer instructions.)"""
    b = p.to(tl.int32)
    low = (((b << 19) & CODE_BITS) | ONE_BITS).to(tl.float32, bitcast=True)
    high = (((b << 15) & CODE_BITS) | ONE_BITS).to(tl.float32, bitcast=True)
    return low, high


@triton.jit
def _unit_nibbles_as(p, dtype: tl.constexpr):
    """uint8 bytes -> (1 + low code / 16, 1 + high code / 16) in dtype (bf16, fp16 or fp32), exact,
    by bits alone: the code in the top four mantissa bits of 1.0 (bf16 0x3F80: bits 3..6; fp16
    0x3C00: bits 6..9)."""
    if dtype == tl.bfloat16:
        b = p.to(tl.int16)
        low = (((b << 3) & 0x78) | 0x3F80).to(tl.bfloat16, bitcast=True)
        high = (((b >> 1) & 0x78) | 0x3F80).to(tl.bfloat16, bitcast=True)
    elif dtype == tl.float16:
        b = p.to(tl.int16)
        low = (((b << 6) & 0x3C0) | 0x3C00).to(tl.float16, bitcast=True)
        high = (((b << 2) & 0x3C0) | 0x3C00).to(tl.float16, bitcast=True)
    else:
        low, high = _unit_nibbles(p)
    return low, high


# Four code bytes in one register -> (1 + low code / 16) and (1 + high code / 16) of each, two
# 16-bit values a register: prmt spreads bytes 0,1 (2,3) into the two 16-bit lanes, a shift puts
# each nibble at the mantissa's top four bits and one lop3 masks it and ors in 1.0's bits:
# 10 instructions for 8 weights, where Triton's per-element int16 code takes ~2.5 a weight (sm_90
# SASS). The same values bit for bit as _unit_nibbles_as. Compiled only (the interpreter has no
# inline assembly). lo and hi_op/hi place each nibble; mask is its four bits, one 1.0 in the dtype.
_NIBBLES_ASM = """
{
.reg .b32 d01, d23, t;
prmt.b32 d01, $4, 0, 0x4140;
prmt.b32 d23, $4, 0, 0x4342;
shl.b32 t, d01, %(lo)s;
lop3.b32 $0, t, %(mask)s, %(one)s, 0xEA;
shl.b32 t, d23, %(lo)s;
lop3.b32 $1, t, %(mask)s, %(one)s, 0xEA;
%(hi_op)s.b32 t, d01, %(hi)s;
lop3.b32 $2, t, %(mask)s, %(one)s, 0xEA;
%(hi_op)s.b32 t, d23, %(hi)s;
lop3.b32 $3, t, %(mask)s, %(one)s, 0xEA;
}
"""
_NIBBLES_ASM_BF16 = tl.constexpr(_NIBBLES_ASM % dict(lo=3, hi_op="shr", hi=1, mask="0x00780078", one="0x3F803F80"))
_NIBBLES_ASM_FP16 = tl.constexpr(_NIBBLES_ASM % dict(lo=6, hi_op="shl", hi=2, mask="0x03C003C0", one="0x3C003C00"))
# The benchmarks' A/B switches (rooflm/envs.py), read on the launch path through envs.cached:
# ROOFLM_W4_ASM=0: Triton's own unpacking everywhere.
# ROOFLM_W4_FUSED_REDUCE=0: split-K partials summed by a second launch (split_k.split_k_reduce), not
# by each tile's last program (the bits are the same either way).
# M <= 8 goes through the hand-written mma.sync kernel (w4a16_mma.py) where it applies; ROOFLM_W4_MMA=0:
# these Triton kernels for every M.
# ROOFLM_W4_SILU_MUL=0: the gated MLP's SiLU-mul stays its own kernel after gate_up (w4a16_gate_up_silu_mul).
# ROOFLM_W4_FOLD=0: the one-token layer keeps its RMSNorm launches (w4a16_folded declines).


@triton.jit
def _unit_nibbles_packed(p, dtype: tl.constexpr):
    """_unit_nibbles_as (bf16 or fp16) in inline PTX, four bytes at a time."""
    if dtype == tl.bfloat16:
        return tl.inline_asm_elementwise(_NIBBLES_ASM_BF16, "=r,=r,=r,=r,r", [p],
                                         dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        return tl.inline_asm_elementwise(_NIBBLES_ASM_FP16, "=r,=r,=r,=r,r", [p],
                                         dtype=(tl.float16, tl.float16), is_pure=True, pack=4)


# Four code bytes in one register -> eight fp32 values for the folded GEMV: one shift of the
# register puts byte j's low nibble at mantissa bits 15..18 and its high nibble at 19..22, and one
# lop3 each masks a nibble and ors in 1.0's bits: (1 + low / 256) and (1 + high / 16), exact.
# 12 instructions for 8 weights (Triton's own code extracts each byte first). $0..$3: the low
# values of bytes 0..3, $4..$7 the high ones, $8 the four bytes.
# (byte j: shifted left by 15 - 8 j, so its low nibble lands at bits 15..18)
_WIDE_SHIFTS = (("shl", 15), ("shl", 7), ("shr", 1), ("shr", 9))
_WIDE_ASM = tl.constexpr("\n{\n.reg .b32 t;\n" + "".join(
    f"{op}.b32 t, $8, {n};\nlop3.b32 ${j}, t, 0x00078000, 0x3F800000, 0xEA;\n"
    f"lop3.b32 ${j + 4}, t, 0x00780000, 0x3F800000, 0xEA;\n" for j, (op, n) in enumerate(_WIDE_SHIFTS)) + "}\n")


@triton.jit
def _unit_nibbles_wide(p, ASM: tl.constexpr):
    """uint8 bytes -> fp32 (1 + low code / 256, 1 + high code / 16), exact: the byte shifted left by
    15 has its low nibble at mantissa bits 15..18 and its high one at 19..22 (one shift, a mask
    and an or each; ASM: the same bits, four bytes at a time in inline PTX)."""
    if ASM:
        return tl.inline_asm_elementwise(_WIDE_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [p],
                                         dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
    b = p.to(tl.int32) << 15
    low = ((b & 0x00078000) | ONE_BITS).to(tl.float32, bitcast=True)
    high = ((b & CODE_BITS) | ONE_BITS).to(tl.float32, bitcast=True)
    return low, high


@triton.jit
def _gemv_folded(x_row, xs_row, qw_ptr, s_ptr, z_ptr, start, end, S, K, N, rn, n_mask,
                 GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, STAGES: tl.constexpr,
                 EVEN: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr, XS: tl.constexpr):
    """y[rn] over bytes start..end of one row of x (the GEMV path, fold): each thread's 16
    consecutive codes of a row (one 16-byte load) are summed against x unscaled, t = sum(w' x)
    with w' = 1 + code / U, one FMA a weight; per row, group and thread then
    sum((code - z) s x) = (U s) t - s (U + z) sum(x) (two FMAs a 16 weights), into an [BLOCK_N,
    GROUP / 16] accumulator reduced across threads once, at the end. The per-weight FMA of the
    scale and zero (fold=False) and its extraction of each byte are gone: ~25% fewer instructions
    a weight under the H100 machine's Triton 3.6 (benchmarks/quant_gemv_sass.py). The fp32 sums lose log2(U) bits to the 1 in w'
    (U = 256 for the low nibble: 16 of 24 left), far under the bf16 result's 8.
    XS: the groups' sums of x come from xs_row (x_group_sums, once a call) instead of being summed
    here every step (their cross-thread reduction puts barriers in the loop)."""
    C: tl.constexpr = GROUP // 16
    kk = (tl.arange(0, C) * 16)[:, None] + tl.arange(0, 16)[None, :]  # a group's bytes: [C, 16]
    w_ptrs = qw_ptr + tl.expand_dims(rn[:, None] * S, 2) + tl.expand_dims(kk, 0)
    kk2 = tl.expand_dims(kk, 2) + tl.expand_dims(tl.expand_dims(tl.arange(0, 2) * S, 0), 0)  # [C, 16, 2]
    acc = tl.zeros([BLOCK_N, C], dtype=tl.float32)
    acc_z = tl.zeros([BLOCK_N], dtype=tl.float32)  # XS: sum of s (U + z) sum(x) over the groups
    s_lo, z_lo, s_hi, z_hi = _group_pair(s_ptr, z_ptr, start, end, S, K, N, rn, n_mask, GROUP, BLOCK_N)
    if PDL:  # x (and its sums) are all that the kernels before write (see the GEMV path)
        gdc_wait()
    for b in tl.range(start, end, GROUP, num_stages=STAGES, loop_unroll_factor=BLOCK_H // GROUP):
        s_lo_n, z_lo_n, s_hi_n, z_hi_n = _group_pair(s_ptr, z_ptr, b + GROUP, end, S, K, N, rn, n_mask,
                                                     GROUP, BLOCK_N)
        p = tl.load(w_ptrs + b, mask=tl.expand_dims(n_mask[:, None], 2), other=0)
        # both halves of x in one [C, 16, 2] load: two elements a thread even at 4 warps, 4 bytes,
        # which Triton's pipeliner takes into cp.async (a 2-byte load it leaves out of the pipeline)
        if EVEN:
            xx = tl.load(x_row + b + kk2)
        else:
            xx = tl.load(x_row + b + kk2, mask=(b + kk2) < K, other=0.0)
        x_lo, x_hi = tl.split(xx.to(tl.float32))
        x_lo = tl.expand_dims(x_lo, 0)
        x_hi = tl.expand_dims(x_hi, 0)
        u_lo, u_hi = _unit_nibbles_wide(p, ASM)
        # sums over each thread's 16 codes; x's sums land in the same [., C] layout as t
        t_lo = tl.sum(u_lo * x_lo, axis=2)
        t_hi = tl.sum(u_hi * x_hi, axis=2)
        acc = tl.fma(t_lo, (256.0 * s_lo)[:, None], acc)
        acc = tl.fma(t_hi, (16.0 * s_hi)[:, None], acc)
        if XS:
            sum_lo = tl.load(xs_row + b // GROUP)
            sum_hi = tl.load(xs_row + (S + b) // GROUP, mask=(S + b) < K, other=0.0)
            acc_z = tl.fma(s_lo * (256.0 + z_lo), sum_lo, acc_z)
            acc_z = tl.fma(s_hi * (16.0 + z_hi), sum_hi, acc_z)
        else:
            acc = tl.fma(tl.sum(x_lo, axis=2), (-s_lo * (256.0 + z_lo))[:, None], acc)
            acc = tl.fma(tl.sum(x_hi, axis=2), (-s_hi * (16.0 + z_hi))[:, None], acc)
        s_lo, z_lo, s_hi, z_hi = s_lo_n, z_lo_n, s_hi_n, z_hi_n
    return tl.sum(acc, axis=1) - acc_z


@triton.jit
def _fold_group(acc, x, w, ones, s, z, PRECISION: tl.constexpr):
    """acc + x @ ((code - z) s).T for one group, from w = 1 + code / 16:
    (16 s) (x @ w.T) - s (16 + z) (x @ ones)."""
    d1 = tl.dot(x, tl.trans(w), input_precision=PRECISION)
    d0 = tl.dot(x, ones, input_precision=PRECISION)
    a = 16.0 * s
    c = s * (16.0 + z)
    return acc + a[None, :] * d1 - c[None, :] * d0


@triton.jit
def _fold_group_t(acc, w, x, s, z, xs, PRECISION: tl.constexpr):
    """_fold_group swapped (acc is [BLOCK_N, BLOCK_M]): acc + ((code - z) s) @ x.T =
    (16 s) (w @ x.T) - s (16 + z) sum(x), the row sums of x (xs, fp32: _row_sums, or loaded from
    x_group_sums' output) in place of a second MMA of the first one's size."""
    d1 = tl.dot(w, tl.trans(x), input_precision=PRECISION)
    a = 16.0 * s
    c = s * (16.0 + z)
    return acc + a[:, None] * d1 - c[:, None] * xs[None, :]


@triton.jit
def _row_sums(x, xs_ptr, k0, K, G, rm, m_mask, GROUP: tl.constexpr, XS: tl.constexpr):
    """Each row's sum of x over the group starting at k0, fp32: from x_group_sums' [M, G] output
    (XS), else summed here from the tile."""
    if XS:
        kk = tl.zeros_like(rm) + k0  # a tensor: the interpreter's masks must be
        return tl.load(xs_ptr + rm.to(tl.int64) * G + k0 // GROUP, mask=m_mask & (kk < K), other=0.0)
    return tl.sum(x.to(tl.float32), axis=1)


@triton.jit
def _group(s_ptr, z_ptr, grp, N, rn, mask):
    """Scale and zero of group `grp` for rows rn, fp32."""
    s = tl.load(s_ptr + grp * N + rn, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + grp * N + rn, mask=mask, other=0.0).to(tl.float32)
    return s, z


@triton.jit
def _group_pair(s_ptr, z_ptr, b, end, S, K, N, rn, n_mask, GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
    """Scales and zeros of the groups at byte b of the low and the high half (zeros past `end`
    or past K: the prefetch after a range's last step)."""
    bb = tl.zeros([BLOCK_N], dtype=tl.int32) + b  # a tensor: the interpreter's masks must be
    lo_ok = n_mask & (bb < end)
    hi_ok = lo_ok & (S + bb < K)
    s_lo, z_lo = _group(s_ptr, z_ptr, b // GROUP, N, rn, lo_ok)
    s_hi, z_hi = _group(s_ptr, z_ptr, (S + b) // GROUP, N, rn, hi_ok)
    return s_lo, z_lo, s_hi, z_hi


@triton.jit
def _gemm_tiles(qw_ptr, x_rows, s_ptr, z_ptr, b, S, K, N, rn, n_mask, m_mask,
                GROUP: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr):
    """The tensor-core path's operands of one group of each nibble at byte b: the bytes of rows
    rn, x's columns of the low and the high half, their scales and zeros (masked past S and K
    unless EVEN)."""
    rg = tl.arange(0, GROUP)
    if EVEN:
        p = tl.load(qw_ptr + rn[:, None] * S + (b + rg)[None, :], mask=n_mask[:, None], other=0)
        x_lo = tl.load(x_rows + (b + rg)[None, :], mask=m_mask[:, None], other=0.0)
        x_hi = tl.load(x_rows + (S + b + rg)[None, :], mask=m_mask[:, None], other=0.0)
        s_lo, z_lo = _group(s_ptr, z_ptr, b // GROUP, N, rn, n_mask)
        s_hi, z_hi = _group(s_ptr, z_ptr, (S + b) // GROUP, N, rn, n_mask)
    else:
        lo_ok = (b + rg) < S
        hi_ok = (S + b + rg) < K
        p = tl.load(qw_ptr + rn[:, None] * S + (b + rg)[None, :], mask=n_mask[:, None] & lo_ok[None, :], other=0)
        x_lo = tl.load(x_rows + (b + rg)[None, :], mask=m_mask[:, None] & lo_ok[None, :], other=0.0)
        x_hi = tl.load(x_rows + (S + b + rg)[None, :], mask=m_mask[:, None] & hi_ok[None, :], other=0.0)
        # (a scalar condition broadcast by hand: the interpreter's masks must be tensors)
        bb = tl.zeros([BLOCK_N], dtype=tl.int32) + b
        s_lo, z_lo = _group(s_ptr, z_ptr, b // GROUP, N, rn, n_mask & (bb < S))
        s_hi, z_hi = _group(s_ptr, z_ptr, (S + b) // GROUP, N, rn, n_mask & (S + bb < K))
    return p, x_lo, x_hi, s_lo, z_lo, s_hi, z_hi


@triton.jit
def _store_partial(y_ptr, ws_ptr, count_ptr, acc, rows, cols, mask, M, N, stride_ym, FUSED: tl.constexpr):
    """Store this program's fp32 partial (rows, cols of y) in the workspace [SPLIT_K, M, N]; FUSED:
    the last of the tile's SPLIT_K programs to get here sums them into y and resets the tile's
    counter."""
    part = ws_ptr + rows.to(tl.int64) * N + cols
    split_stride = tl.cast(M, tl.int64) * N  # (M == 1 comes as a constexpr)
    tl.store(part + tl.program_id(2) * split_stride, acc, mask=mask)
    if FUSED:
        splits = tl.num_programs(2)
        # Every thread's store happens before the counter moves (barrier, then the atomic's release
        # at GPU scope), and the program that draws count SPLIT_K - 1 reads the partials after its
        # acquire (CUTLASS's semaphore pattern); .cg loads read L2, never a stale L1 line. Nobody
        # waits for anybody: the last to arrive does the sum, so no program can block on one that
        # is not resident (nor on a PDL dependent holding its SM).
        tl.debug_barrier()
        tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        count = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if count == splits - 1:
            # split_k_reduce's order exactly: from 0, then + ws[s] for s = 0, 1, ..: the same bits
            total = tl.zeros_like(acc)
            for s in range(0, splits):
                total += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
                part += split_stride
            tl.store(y_ptr + rows.to(tl.int64) * stride_ym + cols, total.to(y_ptr.dtype.element_ty), mask=mask)
            # Back to zero for the next launch, and for the next replay of a CUDA graph holding this one.
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def _w4a16_kernel(y_ptr, ws_ptr, count_ptr, x_ptr, xs_ptr, qw_ptr, s_ptr, z_ptr, M, N, K, S, G, CHUNK,
                  stride_xm, stride_ym,
                  GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
                  SPLIT: tl.constexpr, EVEN: tl.constexpr, PRECISION: tl.constexpr, STAGES: tl.constexpr,
                  FOLD: tl.constexpr, SWAP_AB: tl.constexpr = False, PDL: tl.constexpr = False,
                  ASM: tl.constexpr = False, FUSED: tl.constexpr = False, XS: tl.constexpr = False):
    # BLOCK_H: bytes of a row per step (BLOCK_K / 2 codes in each nibble), a multiple of GROUP.
    # EVEN: K == 2 S and S % BLOCK_H == 0, so no step runs past the row and no mask on K is needed
    # (the GEMV steps one group at a time and needs only K == 2 S).
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rg = tl.arange(0, GROUP)
    start = pid_k * CHUNK
    end = tl.minimum(start + CHUNK, S)
    if BLOCK_M == 1:
        if FOLD:
            acc = _gemv_folded(x_ptr + pid_m.to(tl.int64) * stride_xm, xs_ptr + pid_m.to(tl.int64) * G,
                               qw_ptr, s_ptr, z_ptr, start, end, S, K, N, rn, n_mask,
                               GROUP, BLOCK_N, BLOCK_H, STAGES, EVEN, ASM, PDL, XS)
        else:  # the scale and zero applied to each weight
            x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
            acc = tl.zeros([BLOCK_N, GROUP], dtype=tl.float32)
            # One group of each nibble a step (S and the ranges are whole groups: no mask on the low
            # half; the high half stops at K). Its scales and zeros are loaded a step ahead: 2-byte
            # loads a thread, which Triton's pipeliner does not turn into cp.async, and the zero is
            # needed before the first multiply. BLOCK_K / 2 / GROUP steps are unrolled into one.
            s_lo, z_lo, s_hi, z_hi = _group_pair(s_ptr, z_ptr, start, end, S, K, N, rn, n_mask, GROUP, BLOCK_N)
            # PDL: x is all that the kernel before writes, so the wait comes only here, after the first
            # group's scales and zeros are on their way (the loop's first codes and x are its pipeline's
            # prologue, issued at the loop, after the wait: Triton cannot split them).
            if PDL:
                gdc_wait()
            # tl.range's num_stages pipelines the loop's loads through cp.async (the kernel's
            # num_stages does that only for loads that feed tl.dot): STAGES steps of bytes in flight
            # per program, what a latency-bound stream needs.
            for b in tl.range(start, end, GROUP, num_stages=STAGES, loop_unroll_factor=BLOCK_H // GROUP):
                s_lo_n, z_lo_n, s_hi_n, z_hi_n = _group_pair(s_ptr, z_ptr, b + GROUP, end, S, K, N, rn, n_mask,
                                                             GROUP, BLOCK_N)
                p = tl.load(qw_ptr + rn[:, None] * S + (b + rg)[None, :], mask=n_mask[:, None], other=0)
                x_lo = tl.load(x_row + b + rg).to(tl.float32)
                if EVEN:
                    x_hi = tl.load(x_row + (S + b) + rg).to(tl.float32)
                else:
                    x_hi = tl.load(x_row + (S + b) + rg, mask=(S + b + rg) < K, other=0.0).to(tl.float32)
                u_lo, u_hi = _unit_nibbles(p)
                # (code - zero) s = w' (16 s) - s (16 + zero): one FMA a weight with per-row constants,
                # then one FMA into an elementwise accumulator: no reduction until the end
                # (tl.fma spelled out: the compiler fuses (a + b * c) + d * e only in part)
                w_lo = tl.fma(u_lo, (16.0 * s_lo)[:, None], (-s_lo * (16.0 + z_lo))[:, None])
                w_hi = tl.fma(u_hi, (16.0 * s_hi)[:, None], (-s_hi * (16.0 + z_hi))[:, None])
                acc = tl.fma(w_lo, x_lo[None, :], acc)
                acc = tl.fma(w_hi, x_hi[None, :], acc)
                s_lo, z_lo, s_hi, z_hi = s_lo_n, z_lo_n, s_hi_n, z_hi_n
            acc = tl.sum(acc, axis=1)
        if SPLIT:
            _store_partial(y_ptr, ws_ptr, count_ptr, acc, pid_m, rn, n_mask, M, N, stride_ym, FUSED)
        else:
            tl.store(y_ptr + pid_m.to(tl.int64) * stride_ym + rn, acc.to(y_ptr.dtype.element_ty), mask=n_mask)
        if PDL:  # at the end (see the end of the tensor-core path)
            gdc_launch_dependents()
    else:
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = rm < M
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
        # SWAP_AB: the tile of y.T = W @ x.T. wgmma takes its A operand from registers, B only from
        # shared memory: the unpacked W as A goes straight to the tensor cores, x.T is B.
        acc = tl.zeros([BLOCK_N, BLOCK_M] if SWAP_AB else [BLOCK_M, BLOCK_N], dtype=tl.float32)
        ones = tl.full([GROUP, BLOCK_N], 1.0, dtype=x_ptr.dtype.element_ty)
        if PDL:  # before the pipeline's prologue, which loads x with the first codes (as above)
            gdc_wait()
        for j0 in range(start, end, BLOCK_H):
            for gi in tl.static_range(BLOCK_H // GROUP):
                p, x_lo, x_hi, s_lo, z_lo, s_hi, z_hi = _gemm_tiles(qw_ptr, x_rows, s_ptr, z_ptr, j0 + gi * GROUP,
                                                                    S, K, N, rn, n_mask, m_mask, GROUP, BLOCK_N, EVEN)
                if FOLD:
                    # w' = 1 + code / 16 made in x's dtype by bits alone (exact in bf16/fp16/fp32)
                    # and multiplied as it is; per group and row, sum((code - zero) x) =
                    # 16 sum(w' x) - (16 + zero) sum(x), and sum(x) comes from a dot with ones, so
                    # it is already in the accumulator's layout (swapped: a row sum of x, the dot
                    # with ones would double the MMAs). No float op touches a weight.
                    if ASM:
                        w_lo, w_hi = _unit_nibbles_packed(p, x_lo.dtype)
                    else:
                        w_lo, w_hi = _unit_nibbles_as(p, x_lo.dtype)
                    if SWAP_AB:
                        b = j0 + gi * GROUP
                        acc = _fold_group_t(acc, w_lo, x_lo, s_lo, z_lo,
                                            _row_sums(x_lo, xs_ptr, b, K, G, rm, m_mask, GROUP, XS), PRECISION)
                        acc = _fold_group_t(acc, w_hi, x_hi, s_hi, z_hi,
                                            _row_sums(x_hi, xs_ptr, S + b, K, G, rm, m_mask, GROUP, XS), PRECISION)
                    else:
                        acc = _fold_group(acc, x_lo, w_lo, ones, s_lo, z_lo, PRECISION)
                        acc = _fold_group(acc, x_hi, w_hi, ones, s_hi, z_hi, PRECISION)
                else:
                    u_lo, u_hi = _unit_nibbles(p)
                    if SWAP_AB:
                        # one FMA a weight, then rounded to x's dtype. The step's two dots go into
                        # a fresh tile added to acc after: chained into the loop-carried acc, ptxas
                        # serializes every wgmma (its info C7515, sm_90 SASS checked offline)
                        w_lo = tl.fma(u_lo, (16.0 * s_lo)[:, None], (-s_lo * (16.0 + z_lo))[:, None]).to(x_lo.dtype)
                        w_hi = tl.fma(u_hi, (16.0 * s_hi)[:, None], (-s_hi * (16.0 + z_hi))[:, None]).to(x_hi.dtype)
                        d = tl.dot(w_lo, tl.trans(x_lo), input_precision=PRECISION)
                        acc += tl.dot(w_hi, tl.trans(x_hi), d, input_precision=PRECISION)
                    else:
                        # (code - zero) * scale = (w' - (1 + zero / 16)) * 16 scale; the subtract is
                        # exact (both terms in [1, 2)), per-row constants outside the per-weight work
                        w_lo = ((u_lo - (1.0 + z_lo * 0.0625)[:, None]) * (16.0 * s_lo)[:, None]).to(x_lo.dtype)
                        w_hi = ((u_hi - (1.0 + z_hi * 0.0625)[:, None]) * (16.0 * s_hi)[:, None]).to(x_hi.dtype)
                        acc = tl.dot(x_lo, tl.trans(w_lo), acc, input_precision=PRECISION)
                        acc = tl.dot(x_hi, tl.trans(w_hi), acc, input_precision=PRECISION)
        if SWAP_AB:
            acc = tl.trans(acc)  # renames the registers' dimensions (no data moved): y's tile
        mn_mask = m_mask[:, None] & n_mask[None, :]
        if SPLIT:
            _store_partial(y_ptr, ws_ptr, count_ptr, acc, rm[:, None], rn[None, :], mn_mask, M, N, stride_ym,
                           FUSED)
        else:
            offs = rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
            tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mn_mask)
        # PDL: the next kernel is released only at the end, in both paths. Released after the main
        # loop, it starts while this grid's programs still hold most SMs, and so does the kernel
        # after it when that one releases at its start (RMSNorm, SiLU-mul): the next W4 grid, one
        # wave of 256..384 programs here, then lands on whatever slots are free, unevenly. Before
        # the fused sum, split_k_reduce (launched without PDL) kept that from happening. H100,
        # Llama-3-8B int4 decode at batch 1 (benchmarks/quant_decode.py): 296 tok/s with two
        # launches, 289 with the fused sum released after the loop, 313 released here; a layer's
        # four W4 linears alone in a CUDA graph: 81.1 us, 87.6, 78.3. Either place is safe with
        # the split sum after it: a dependent's gdc_wait waits for this whole grid to complete and
        # its memory to be flushed, not for the release, and no program waits for another (the
        # last split to arrive sums), so a dependent holding an SM cannot stall this grid.
        if PDL:
            gdc_launch_dependents()


# --------------------------------------------------------------------------
# Wrapper
# --------------------------------------------------------------------------

class W4Config(NamedTuple):
    block_m: int      # 1: the GEMV path (one row of x per program); >= 16: tensor-core tiles
    block_n: int
    block_k: int      # codes of K per step: block_k / 2 bytes, block_k / 2 of each nibble
    num_warps: int
    num_stages: int
    split_k: int = 1  # programs per row block along K (fp32 partials, then one sum)
    # Tensor-core tiles: exact 1 + code / 16 and the scale per group (else per weight). GEMV
    # (block_m 1): _gemv_folded's per-thread sums (else the scale and zero applied to each weight).
    fold: bool = True
    swap_ab: bool = False  # tensor-core tiles: y.T = W @ x.T, the unpacked W wgmma's A operand from registers
    # Registers a thread may hold (ptxas .maxnreg), 0: the compiler's choice. At batch 1 the small
    # shapes are latency-bound at 157 registers, 3 CTAs an SM (Nsight Compute,
    # benchmarks/results/quant-w4-ncu-h100-20261127): a cap buys CTAs, so loads in flight, for spills.
    # On the H100 every capped tile swept (128, 96) was slower: a sweep candidate, not in the table.
    maxnreg: int = 0
    # The fold's per-group sums of x (GEMV fold and swap-AB fold) computed once a call by
    # x_group_sums (one small launch) instead of in every program: at M = 64 the row sums cost about
    # as much as the unpacking, recomputed by each of the N / block_n programs of a K range.
    x_sums: bool = False


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def check_config(cfg: W4Config, group_size: int) -> None:
    """Raise on tiles the kernel cannot take (a hand-made or tabled config)."""
    problems = []
    if not (_pow2(cfg.block_n) and _pow2(cfg.block_k) and _pow2(cfg.block_m)):
        problems.append("block_m, block_n, block_k must be powers of two")
    if cfg.block_m != 1 and (cfg.block_m < 16 or cfg.block_n < 16):
        problems.append("tensor-core tiles (block_m > 1) need block_m and block_n >= 16")
    if cfg.swap_ab and cfg.block_m == 1:
        problems.append("swap_ab is for tensor-core tiles (block_m >= 16)")
    if cfg.block_k % (2 * group_size):
        problems.append(f"block_k must hold whole groups in each nibble: a multiple of 2 x {group_size}")
    if cfg.split_k < 1 or cfg.num_warps < 1 or cfg.num_stages < 1:
        problems.append("split_k, num_warps, num_stages must be >= 1")
    if cfg.x_sums and not (cfg.fold and (cfg.block_m == 1 or cfg.swap_ab)):
        problems.append("x_sums is for the folded GEMV (block_m 1) and folded swap-AB tiles")
    if cfg.maxnreg and not 24 <= cfg.maxnreg <= 255:
        problems.append("maxnreg must be 0 (uncapped) or 24..255 registers")
    if problems:
        raise ValueError(f"W4A16 config {cfg}: " + "; ".join(problems))


@functools.lru_cache(maxsize=256)
def pick_config(m: int, n: int, k: int, group: int, device_name: Optional[str] = None, sms: int = 132) -> W4Config:
    """The measured tiles of rooflm/kernels/tuned/weight_only.json for this GPU and shape, else a
    heuristic: one row of x on CUDA cores with narrow BLOCK_N and split-K to fill the SMs at M == 1,
    tensor-core tiles of 16..64 rows of x above."""
    tabled = lookup("w4a16", device_name, n, k, m, group)
    if tabled is not None:
        cfg = W4Config(**tabled)
        check_config(cfg, group)
        return cfg
    block_k = 2 * max(group, 128)
    iterations = -(-int4_split(k, group) // (block_k // 2))
    if m == 1:  # 32 rows a program: fewer instructions a weight than 16 (sm_90 SASS counts). The
        # per-weight GEMV: the folded one, with ~25% fewer instructions, was slower on every 8B
        # shape on the H100 (gate_up 45.4 against 38.4 us; benchmarks/results/quant-w4-fold-h100-20261127)
        return W4Config(1, 32, block_k, 4, 4, split_for(-(-n // 32), iterations, sms), fold=False)
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 64
    programs = -(-n // block_n) * -(-m // block_m)
    return W4Config(block_m, block_n, block_k, 4, 3, split_for(programs, iterations, sms))


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, config: Optional[W4Config] = None) -> torch.Tensor:
    """x [M, K] (fp16/bf16/fp32) @ W.T for W in the layout above; returns [M, N] in x's dtype.
    config: tiles to use instead of pick_config's (benchmarks sweep them)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    m, k = x.shape
    n = qweight.shape[0]
    if k % group_size or group_size % 16 or not _pow2(group_size):
        raise ValueError(f"K={k} must be a multiple of the group size {group_size} (a power of two >= 16)")
    split = int4_split(k, group_size)
    if qweight.dtype != torch.uint8 or qweight.shape[1] != split:
        raise ValueError(f"qweight must be uint8 [N, int4_split(K, g)] = [{n}, {split}] (rooflm.quant.formats."
                         f"pack_int4), got {qweight.dtype} {tuple(qweight.shape)}")
    groups = k // group_size
    if scales.shape != (groups, n) or zeros.shape != (groups, n):
        raise ValueError(f"scales and zeros must be [K/g, N] = [{groups}, {n}], got "
                         f"{tuple(scales.shape)} and {tuple(zeros.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if envs.cached.ROOFLM_W4_MMA and config is None and 0 < m <= w4a16_mma.MAX_M and w4a16_mma.supported(x, qweight, scales, zeros, k, group_size):
        mma_cfg = w4a16_mma.pick_config(m, n, k, group_size, device_facts(x.device)[0])
        return w4a16_mma.w4a16_mma(x, qweight, scales, zeros, group_size, mma_cfg, pdl=pdl_supported(x.device))
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    cfg = config or pick_config(m, n, k, group_size, *device_facts(x.device))
    check_config(cfg, group_size)
    half = cfg.block_k // 2
    iterations = triton.cdiv(split, half)
    per_split = triton.cdiv(iterations, cfg.split_k)
    split_k = triton.cdiv(iterations, per_split)  # no empty splits
    ws = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else y
    grid = (triton.cdiv(n, cfg.block_n), m if cfg.block_m == 1 else triton.cdiv(m, cfg.block_m), split_k)
    fused = split_k > 1 and envs.cached.ROOFLM_W4_FUSED_REDUCE
    # one counter per output tile (zero between launches), shared with the other split-K kernels
    counters = tile_counters(x.device, grid[0] * grid[1]) if fused else ws
    xs = x_group_sums(x, group_size) if cfg.x_sums else x
    _w4a16_kernel[grid](y, ws, counters, x, xs, qweight, scales, zeros, m, n, k, split, groups, per_split * half,
                        x.stride(0), y.stride(0),
                        GROUP=group_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_H=half,
                        SPLIT=split_k > 1, EVEN=(k == 2 * split and split % half == 0),
                        # fp32 activations multiply in full precision (tl.dot would take tf32)
                        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                        STAGES=1 if is_interpreter() else cfg.num_stages, FOLD=bool(cfg.fold),
                        SWAP_AB=bool(cfg.swap_ab),
                        ASM=envs.cached.ROOFLM_W4_ASM and not is_interpreter() and x.dtype in (torch.bfloat16, torch.float16),
                        FUSED=fused, XS=bool(cfg.x_sums),
                        num_warps=cfg.num_warps, num_stages=1 if is_interpreter() else cfg.num_stages,
                        **pdl_launch(x.device), **({"maxnreg": cfg.maxnreg} if cfg.maxnreg and not is_interpreter() else {}))
    if split_k > 1 and not fused:
        split_k_reduce(y, ws)
    return y


def w4a16_gate_up_silu_mul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                           group_size: int) -> Optional[torch.Tensor]:
    """silu(gate) * up [M, I] for the gated MLP's gate_up weight [2I, K] (gate rows, then up rows) in
    one launch: the mma kernel's blocks pair each gate row with its up row and apply SiLU-mul in
    their epilogue, so gate_up is never written and silu_mul is not launched. None where that kernel
    does not take the call (the caller runs w4a16_linear, then silu_mul)."""
    if not (envs.cached.ROOFLM_W4_MMA and envs.cached.ROOFLM_W4_SILU_MUL):
        return None
    return _mma_fused(x, qweight, scales, zeros, group_size, gated=True)


def w4a16_folded(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, *, norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6,
                 residual: Optional[torch.Tensor] = None, gated: bool = False) -> Optional[torch.Tensor]:
    """One token's W4 linear with the layer's neighbours folded into the mma kernel, as gemv.py does
    for float weights: W @ rmsnorm(x) with norm_weight (x the residual stream; gated: silu(gate) *
    up of it), residual + W x with residual [1, N]. None where that kernel does not take the call
    (the caller runs the norm, the linear and the add as separate kernels)."""
    if not (envs.cached.ROOFLM_W4_MMA and envs.cached.ROOFLM_W4_FOLD) or (gated and not envs.cached.ROOFLM_W4_SILU_MUL) or x.dim() != 2 or x.shape[0] != 1:
        return None
    return _mma_fused(x, qweight, scales, zeros, group_size, norm_weight=norm_weight, eps=eps, residual=residual,
                      gated=gated)


def _mma_fused(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
               *, norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6,
               residual: Optional[torch.Tensor] = None, gated: bool = False) -> Optional[torch.Tensor]:
    """The mma kernel with its epilogue / prologue variants (gated SiLU-mul, NORM, RESIDUAL) where it
    takes the call, else None. NORM and RESIDUAL need one row."""
    if x.dim() != 2 or not 0 < x.shape[0] <= w4a16_mma.MAX_M:
        return None
    m, k = x.shape
    n = qweight.shape[0]
    if gated and (n % 2 or residual is not None):
        return None
    if (norm_weight is not None or residual is not None) and m != 1:
        return None
    if norm_weight is not None and (norm_weight.dtype != x.dtype or not norm_weight.is_contiguous()
                                    or norm_weight.numel() != k or norm_weight.data_ptr() % 16 or k % 8):
        return None
    out = n // 2 if gated else n
    if residual is not None and (residual.dtype != x.dtype or residual.numel() != out or residual.stride(-1) != 1):
        return None
    if not w4a16_mma.supported(x, qweight, scales, zeros, k, group_size):
        return None
    cfg = w4a16_mma.pick_config(m, n, k, group_size, device_facts(x.device)[0])
    if gated and n % (16 * cfg.tiles):
        return None
    return w4a16_mma.w4a16_mma(x, qweight, scales, zeros, group_size, cfg, pdl=pdl_supported(x.device), gated=gated,
                               norm_weight=norm_weight.reshape(k) if norm_weight is not None else None, eps=eps,
                               residual=residual.reshape(1, out) if residual is not None else None)


@triton.jit
def _x_group_sums_kernel(x_ptr, out_ptr, G, stride_xm, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                         PDL: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    rg = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    if PDL:  # x is what the kernel before writes
        gdc_wait()
    x = tl.load(x_ptr + row * stride_xm + rg[:, None] * GROUP + tl.arange(0, GROUP)[None, :],
                mask=(rg < G)[:, None], other=0.0)
    tl.store(out_ptr + row * G + rg, tl.sum(x.to(tl.float32), axis=1), mask=rg < G)
    if PDL:
        gdc_launch_dependents()


def x_group_sums(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """[M, K / g] fp32: each row's sum of x over each group of g columns (W4Config.x_sums)."""
    m, k = x.shape
    groups = k // group_size
    out = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    block_g = max(1, min(triton.next_power_of_2(groups), 8192 // group_size))
    _x_group_sums_kernel[(m, triton.cdiv(groups, block_g))](x, out, groups, x.stride(0), GROUP=group_size,
                                                              BLOCK_G=block_g, **pdl_launch(x.device))
    return out


# --------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------

def dequantize_w4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  group_size: int) -> torch.Tensor:
    """W [N, K] in fp32 from the runtime layout."""
    codes = unpack_int4(qweight, scales.shape[0] * group_size).float()
    s = scales.float().T.repeat_interleave(group_size, dim=1)
    z = zeros.float().T.repeat_interleave(group_size, dim=1)
    return (codes - z) * s


def w4a16_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     group_size: int) -> torch.Tensor:
    """Dequantize, then an fp32 matmul; the result in x's dtype."""
    return (x.float() @ dequantize_w4(qweight, scales, zeros, group_size).T).to(x.dtype)


def w4a16_bytes(m: int, n: int, k: int, group_size: int, act_bytes: int = 2) -> int:
    """Bytes one call must move: codes, scales and zeros, x and y."""
    return n * int4_split(k, group_size) + 2 * act_bytes * n * (k // group_size) + act_bytes * (m * k + m * n)
