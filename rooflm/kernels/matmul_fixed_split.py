"""A batch-invariant split-K matmul: y = x @ W^T (+ bias), with a split count fixed by the weight.

Why
---
The persistent matmul (matmul_persistent.py) keeps every element's sum in one K loop, so at
decode sizes (M <= 64, one row of 64 x 64 tiles) a narrow projection has only N / 64 programs:
64 for N = 4096 on the H100's 132 SMs, too few to read the weight at full bandwidth (measured:
batch-1 decode +32% and 64 x 1024/256 +20% over the default mode, the target is 10%).
Split-K gives each output tile more programs, but an ordinary split-K picks its split count
from M and so changes the order of the sums with the batch. Here the split count S is a
property of the weight's shape (N, K), the dtype's BLOCK_K and the device's SM count, never of
M, and the order of every element's sum is defined by S alone:

    split s covers k in [s SPLIT_K, min((s + 1) SPLIT_K, K)), SPLIT_K a multiple of BLOCK_K;
    acc_s = 0 (fp32);  for k0 in split s, in steps of BLOCK_K:  acc_s += x[m, k0:k0+BK] . W[n, k0:k0+BK]
    total = acc_0;  for s in 1 .. S-1:  total = total + acc_s      (fp32, in order of s)
    y[m, n] = (total + bias[n]).to(out dtype)

(Starting total from acc_0 rather than from 0 changes nothing but the sign of an exact zero, and
makes S = 1 exactly the persistent matmul's order, so S = 1 weights simply call it.) Each dot
is one tl.dot of BLOCK_K depth, BLOCK_K and the dot precision are matmul_persistent's, and
tile widths only pick which program sums which elements (checked bitwise on the H100 for the
persistent kernel: benchmarks/deterministic_tiles.py). Two schedules execute that order:

  "programs" (small M): S programs per output tile, each computes one split's acc_s and
      stores it, fp32, in a workspace [S, M, N]; the last of the tile's S programs to finish
      (an atomic counter per tile) reads acc_0 .. acc_{S-1} back, adds them in order of s,
      adds the bias and writes y. One launch: a second reduce kernel would add a launch per
      linear layer, 224 per decode step of Llama-3-8B, each a few microseconds.
  "loop" (large M): a persistent program per tile loops over the S splits itself, resetting
      acc at each split and adding it to total in order of s. There are enough tiles to fill
      the SMs already; the split costs one fp32 tile add per split, and a tile of at most
      128 x 128 (MAX_LOOP_TILE: acc and total must both stay in registers).

Only the schedule follows M (SPLIT_PROGRAMS_MAX_M); the sums do not. tests/kernels/
test_deterministic.py checks both schedules against each other and across M, bitwise.

Choosing S
----------
split_plan(): S = ceil(#SMs / number of 64-wide column tiles), capped at MAX_SPLITS and at the
number of K steps, so that a decode step's grid fills the SMs: on the H100 and Llama-3-8B,
o (4096 x 4096) and down (4096 x 14336) get S = 3, qkv (6144 x 4096) S = 2, gate_up and the LM
head S = 1 (they have 448 and 2004 tiles already). The SM count makes S, and so the bits, a
property of the GPU model as well, as the choice of kernels already is (docs/deterministic.md: "other GPUs
... not covered").

Work
----
FLOPs = 2 M N K, as unsplit. Bytes: the weight, N K e, plus the workspace, S M N 4 written and
S M N 4 read back. At M = 1 that is 8 S N against 2 N K for bf16 weights: the ratio is 4 S / K,
0.3% for o (S = 3, K = 4096), 0.08% for down (K = 14336), 0.2% for qkv; and the workspace is a
few tens of KB that stays in L2. It grows with M (at M = 64, o: 19% of the weight bytes, still
L2-resident: 3 MB), which is why large M takes the "loop" schedule, whose extra work is
register adds only.

Shapes
------
x [M, K] (unit last stride), W [N, K] (torch.nn.Linear layout), bias [N] or None; y [M, N].
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

import rooflm.envs as envs
from rooflm.kernels.matmul_persistent import _tile_coords, check_matmul_inputs, matmul_config, matmul_persistent
from rooflm.kernels.split_k import tile_counters
from rooflm.kernels.utils import cdiv, check_last_dim_contiguous, dot_precision, num_sms, upcast_dots


# --------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------

@triton.jit
def _split_acc(x_ptr, w_ptr, offs_m, offs_n, m_ok, n_ok, K, k_start, k_end, stride_xm, stride_wn,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc_s for one tile: the dots of k0 = k_start, k_start + BLOCK_K, .. < k_end, from a zero acc."""
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + (k_start + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + (k_start + offs_k)[:, None]  # W^T tile [BK, BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_ok = offs_k < K - k0  # split bounds are multiples of BLOCK_K: only K's last step is partial
        a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter's bf16 dot (utils.upcast_dots); never compiled
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


# M changes every step: not specialised on (one compiled kernel, one code path, for every batch).
@triton.jit(do_not_specialize=["M"])
def _split_programs_kernel(y_ptr, ws_ptr, count_ptr, x_ptr, w_ptr, bias_ptr, M, N, K, SPLIT_K, num_splits,
                           stride_xm, stride_wn, stride_ym,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # Neighbouring programs are the splits of one tile: they finish close together, so the
    # last one (which does the in-order sum) waits for nobody.
    pid = tl.program_id(0)
    split = pid % num_splits
    tile = pid // num_splits
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = tile // num_pid_n
    pid_n = tile % num_pid_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    tile_ok = m_ok[:, None] & n_ok[None, :]
    k_start = split * SPLIT_K
    k_end = tl.minimum(k_start + SPLIT_K, K)
    acc = _split_acc(x_ptr, w_ptr, offs_m, offs_n, m_ok, n_ok, K, k_start, k_end, stride_xm, stride_wn,
                     BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, UPCAST)
    # Workspace [S, M, N], fp32: acc_s exactly as computed.
    ws_tile = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    split_stride = M.to(tl.int64) * N
    tl.store(ws_ptr + split * split_stride + ws_tile, acc, mask=tile_ok)
    # Every thread's store happens before the counter moves (barrier, then the atomic's release
    # at GPU scope), and the program that sees count S - 1 reads the partials after its acquire
    # (CUTLASS's semaphore pattern); .cg loads read L2, never a stale L1 line.
    tl.debug_barrier()
    count = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if count == num_splits - 1:
        total = tl.load(ws_ptr + ws_tile, mask=tile_ok, other=0.0, cache_modifier=".cg")
        for s in range(1, num_splits):
            total += tl.load(ws_ptr + s * split_stride + ws_tile, mask=tile_ok, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            total += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=tile_ok)
        # Back to zero for the next launch, and for the next replay of a CUDA graph that holds this one.
        tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["M", "num_programs"])
def _split_loop_kernel(y_ptr, x_ptr, w_ptr, bias_ptr, M, N, K, SPLIT_K, num_programs,
                       stride_xm, stride_wn, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       UPCAST: tl.constexpr):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    for tile in range(tl.program_id(0), num_tiles, num_programs):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_m < M
        n_ok = offs_n < N
        total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k_start in range(0, K, SPLIT_K):
            k_end = tl.minimum(k_start + SPLIT_K, K)
            acc = _split_acc(x_ptr, w_ptr, offs_m, offs_n, m_ok, n_ok, K, k_start, k_end, stride_xm, stride_wn,
                             BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, UPCAST)
            total = tl.where(k_start == 0, acc, total + acc)  # total = acc_0, then + acc_s in order
        if HAS_BIAS:
            total += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# --------------------------------------------------------------------------
# Split plan and wrapper
# --------------------------------------------------------------------------

# Off by default (1: the persistent matmul's order for every weight); ROOFLM_DETERMINISTIC_MAX_SPLITS=8
# turns it on (beyond a few splits the grid is full and the partials only cost workspace traffic).
# benchmarks/deterministic.sh measures the engine both ways. On the H100 (2026-11-26,
# benchmarks/results/deterministic-tma-h100-20261126/), with the persistent matmul's TMA loads
# above M = 64, the split cost ShareGPT-like traffic +47.5% against +22.8% without it and a
# 64-prompt prefill +23% against +1%; it saves only batch-1 decode (+25% against +32%).
# The "programs" schedule up to this M (the persistent matmul's narrow-tile bucket): one row of
# 64 x 64 tiles, a workspace that stays in L2. Above it, the "loop" schedule.
SPLIT_PROGRAMS_MAX_M = 64
SCHEDULES = ("programs", "loop")
# The "loop" schedule holds two fp32 tiles, the split's acc and the running total: 2 x 128 x 128
# x 4 bytes is half the H100 SM's 256 KB register file, while the persistent matmul's 128 x 256
# prefill tile would need all of it (compiled for sm_90: 255 registers and 668 bytes of spills
# per thread, against none at 128 x 128 with 8 warps). So its tile is capped at this many elements.
MAX_LOOP_TILE = 128 * 128
_LOOP_CAPPED = {torch.bfloat16: (128, 128, 64, 8, 8, 3), torch.float16: (128, 128, 64, 8, 8, 3)}


def loop_config(dtype: torch.dtype, m: int) -> tuple[int, int, int, int, int, int]:
    """The "loop" schedule's tile: the persistent matmul's bucket for m, unless too wide for two tiles."""
    config = matmul_config(dtype, m)
    if config[0] * config[1] > MAX_LOOP_TILE:
        config = _LOOP_CAPPED[dtype]
    return config


@functools.lru_cache(maxsize=256)  # called per linear per step: a dict lookup, not arithmetic
def split_plan(n: int, k: int, dtype: torch.dtype, sms: int) -> tuple[int, int]:
    """(S, SPLIT_K) for a weight [n, k]: from the weight's shape, its dtype's BLOCK_K and the SM
    count only, never from M (that is the whole point). SPLIT_K is a multiple of BLOCK_K; the
    last split may be shorter. S = 1 means no split (the persistent matmul's order)."""
    _, block_n, block_k = matmul_config(dtype, 1)[:3]
    k_steps = cdiv(k, block_k)
    if k_steps == 0:
        return 1, block_k
    splits = min(cdiv(sms, cdiv(n, block_n)), envs.cached.ROOFLM_DETERMINISTIC_MAX_SPLITS, k_steps)
    split_k = split_size(k, splits, block_k)
    return cdiv(k, split_k), split_k


def split_size(k: int, splits: int, block_k: int) -> int:
    """SPLIT_K for about `splits` splits of K: whole BLOCK_K steps, the last split the short one."""
    return max(cdiv(cdiv(k, block_k), splits), 1) * block_k


@functools.lru_cache(maxsize=16)
def _device_sms(device: torch.device) -> int:
    return num_sms(device.index or 0) if device.type == "cuda" else num_sms()


def matmul_fixed_split(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                       out_dtype: Optional[torch.dtype] = None, splits: Optional[int] = None,
                       schedule: Optional[str] = None,
                       config: Optional[tuple[int, int, int, int, int, int]] = None) -> torch.Tensor:
    """y = x @ weight^T + bias, each element summed in the fixed-split order of split_plan.

    x [..., K]; weight [N, K]; bias [N]. splits overrides split_plan's S (benchmarks compare
    counts; a caller that wants batch invariance must pass the same S for a weight at every M);
    schedule ("programs" | "loop") overrides the choice by M; config overrides the tile shape
    (its BLOCK_K must be the dtype's, as in matmul_persistent).
    """
    n, k = check_matmul_inputs(x, weight, bias)
    if schedule is not None and schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    check_last_dim_contiguous("weight", weight)
    sms = _device_sms(x.device)
    block_k = matmul_config(x.dtype, 1)[2]
    if splits is None:
        splits, split_k = split_plan(n, k, x.dtype, sms)
    else:
        if splits < 1:
            raise ValueError(f"splits must be >= 1, got {splits}")
        split_k = split_size(k, splits, block_k)
        splits = cdiv(k, split_k)
    if splits == 1:  # S = 1 is the persistent matmul's order exactly (see the header)
        return matmul_persistent(x, weight, bias, out_dtype, config)

    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y.reshape(*lead, n)
    if schedule is None:
        schedule = "programs" if m <= SPLIT_PROGRAMS_MAX_M else "loop"
    block_m, block_n, cfg_block_k, group_m, num_warps, num_stages = config or (
        matmul_config(x.dtype, 1) if schedule == "programs" else loop_config(x.dtype, m))
    if cfg_block_k != block_k:
        raise ValueError(f"config's BLOCK_K {cfg_block_k} is not {x.dtype}'s {block_k}: the sums would change")
    common = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
                  DOT_PRECISION=dot_precision(x.dtype), UPCAST=upcast_dots(x.dtype),
                  num_warps=num_warps, num_stages=num_stages)
    bias_arg = bias if bias is not None else weight
    if schedule == "programs":
        tiles = cdiv(m, block_m) * cdiv(n, block_n)
        workspace = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
        counters = tile_counters(x.device, tiles)
        _split_programs_kernel[(tiles * splits,)](
            y, workspace, counters, x2, weight, bias_arg, m, n, k, split_k, splits,
            x2.stride(0), weight.stride(0), y.stride(0), **common)
    else:
        tiles = cdiv(m, block_m) * cdiv(n, block_n)
        programs = min(sms, tiles)
        _split_loop_kernel[(programs,)](
            y, x2, weight, bias_arg, m, n, k, split_k, programs,
            x2.stride(0), weight.stride(0), y.stride(0), GROUP_M=group_m, **common)
    return y.reshape(*lead, n)


# --------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------

def matmul_fixed_split_ref(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                           out_dtype: Optional[torch.dtype] = None, splits: Optional[int] = None,
                           block_k: Optional[int] = None, sms: Optional[int] = None) -> torch.Tensor:
    """The fixed-split order in torch, fp32: the same splits, BLOCK_K steps and in-order adds.

    Each BLOCK_K step is one torch matmul, whose internal order is BLAS's, not the matrix unit's:
    bitwise equal to the kernel where every step's dot is exact (the interpreter tests' inputs),
    within rounding otherwise.
    """
    n, k = weight.shape
    if block_k is None:
        block_k = matmul_config(x.dtype, 1)[2]
    if splits is None:
        splits, split_k = split_plan(n, k, x.dtype, sms if sms is not None else _device_sms(x.device))
    else:
        split_k = split_size(k, splits, block_k)
    xf = x.reshape(-1, k).float()
    wf = weight.float()
    total = None
    for k_start in range(0, k, split_k):
        acc = torch.zeros(xf.shape[0], n, dtype=torch.float32, device=x.device)
        for k0 in range(k_start, min(k_start + split_k, k), block_k):
            k1 = min(k0 + block_k, k)
            acc = acc + xf[:, k0:k1] @ wf[:, k0:k1].t()
        total = acc if total is None else total + acc
    if total is None:
        total = torch.zeros(xf.shape[0], n, dtype=torch.float32, device=x.device)
    if bias is not None:
        total = total + bias.float()
    return total.to(out_dtype or x.dtype).reshape(*x.shape[:-1], n)
