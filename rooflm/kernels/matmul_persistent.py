"""A batch-invariant matmul for linear layers: y = x @ W^T (+ bias), persistent, in Triton.

Why
---
cuBLAS picks its algorithm (tile shape, split-K, stream-K) from M, the number of
tokens in the step, so the same token's row of y is summed in a different order
when it runs alone, beside 63 others, or in a 2048-token prefill chunk. The sums
differ in their last bits, and greedy decoding turns last bits into different
tokens. This kernel sums every output element in one order whatever M is
(--deterministic, rooflm/deterministic/): the row's result depends on its own
inputs only.

Algorithm
---------
No split-K: element (m, n) is

    acc = 0 (fp32);  for k0 in 0, BLOCK_K, 2 BLOCK_K, ...:  acc += x[m, k0:k0+BK] . W[n, k0:k0+BK]
    y[m, n] = (acc + bias[n]).to(out dtype)

with each step's dot one tl.dot of BLOCK_K depth, which the matrix units run as k16 slices
added into the fp32 acc in k order. BLOCK_M, BLOCK_N, warps and stages only decide which
program computes which elements, and BLOCK_K how many slices one loop step issues, not the
order of any element's sum: on the H100 every tile measured gave rows bitwise equal at M = 1
and 2048 (benchmarks/deterministic_kernels.py, "same sums"; BLOCK_K 64/128/256, BLOCK_M 16,
where Triton issues mma.sync instead of wgmma, and 64-256). So the tile may follow M
(MATMUL_BUCKETS: narrow tiles that spread a decode step's weight reads over all SMs, wide
ones for prefill chunks; BATCH1_CONFIGS for steps of at most 16 rows) while the dot precision
never does; tests/kernels/test_deterministic.py checks rows bitwise across M on the GPU. The
buckets keep one BLOCK_K per dtype anyway (check_buckets): matmul_fixed_split.py's split
boundaries are whole steps of it. The kernel is persistent: a grid of
min(#SMs, #tiles) programs walks the tiles (grouped along M so that neighbouring
programs share W tiles in L2), which keeps launches cheap and the grid small.
Rows past M and columns past N are masked loads (zeros) and masked stores.

Shapes
------
x [M, K] (unit last stride), W [N, K] (torch.nn.Linear layout, unit last stride),
bias [N] or None; y [M, N] in out_dtype (default x's dtype).

Work
----
FLOPs = 2 M N K.  Bytes >= (M K + N K) e + M N e_out: a decode step (small M) is
bound by reading W (memory), a prefill chunk (M in the thousands) by the matrix
units (compute). Tile widths per M bucket serve both: their cost against
cuBLAS is measured by benchmarks/deterministic.sh and the buckets are chosen by
benchmarks/deterministic_tiles.py.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from rooflm.kernels.utils import (cdiv, check_last_dim_contiguous, dot_precision, gdc_launch_dependents, gdc_wait,
                                  is_interpreter, num_sms, pdl_launch, upcast_dots)


# --------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------

@triton.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Tile index -> (pid_m, pid_n), GROUP_M row tiles at a time (L2 reuse of W tiles)."""
    tiles_per_group = GROUP_M * num_pid_n
    group = tile // tiles_per_group
    first_m = group * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % tiles_per_group) % group_rows
    pid_n = (tile % tiles_per_group) // group_rows
    return pid_m, pid_n


# M and the program count change every step: not specialised on, so one compiled kernel serves
# every batch (specialising on M == 1 would also give decode its own code, and maybe its own sums).
@triton.jit(do_not_specialize=["M", "num_programs"])
def _matmul_persistent_kernel(y_ptr, x_ptr, w_ptr, bias_ptr, M, N, K, num_programs,
                              stride_xm, stride_wn, stride_ym,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                              UPCAST: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # launched while the kernel before drains (utils.pdl_supported): wait for its x
        gdc_launch_dependents()
        gdc_wait()
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    offs_k = tl.arange(0, BLOCK_K)
    for tile in range(tl.program_id(0), num_tiles, num_programs):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_m < M
        n_ok = offs_n < N
        x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
        w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]  # W^T tile [BK, BN]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        # The K loop: always from 0 in steps of BLOCK_K, one dot per step, whatever M is.
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k < K - k0
            a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if UPCAST:  # the interpreter's bf16 dot (utils.upcast_dots); never compiled
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M", "num_programs"])
def _matmul_persistent_tma_kernel(y_ptr, x_desc, w_desc, bias_ptr, M, N, K, num_programs, stride_ym,
                                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                  GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr,
                                  DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr = False):
    """The same tiles and the same K loop as _matmul_persistent_kernel, with the x and W tiles
    brought in by the Hopper tensor-memory accelerator (TMA: one descriptor per operand, zeros
    past the edges) instead of per-thread address arithmetic and masks. Only how the tiles
    arrive changes: each element's sum is the same dots in the same order."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    for tile in tl.range(tl.program_id(0), num_tiles, num_programs, flatten=True):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = x_desc.load([off_m, k0])
            b = w_desc.load([off_n, k0])
            if UPCAST:  # the interpreter's bf16 dot (utils.upcast_dots); never compiled
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b.T, acc, input_precision=DOT_PRECISION)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & n_ok[None, :])


# --------------------------------------------------------------------------
# Wrapper
# --------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) by dtype, as (largest M, config)
# buckets. BLOCK_K is one per dtype (it fixes the order of the sums; checked below); the rest
# may follow M. 128 x 128 x 64 with 8 warps is the shape vLLM's and the Thinking Machines
# batch-invariant matmuls use for 16-bit inputs on Hopper; fp32 tiles are twice the bytes and
# take half the K step to stay within shared memory (one bucket: fp32 sums on the CUDA cores).
# The 16-bit buckets are benchmarks/deterministic_tiles.py's choice on the H100 (2026-11-23,
# benchmarks/results/deterministic-h100-20261123/): 64 x 64 tiles with 6 stages spread a decode
# step's weight reads over the SMs (1.0-1.2x cuBLAS's time up to M = 64, against 1.1-2.3x for
# 128 x 128). Above M = 64 the tiles come in through TMA on Hopper (TMA_MIN_M), with the tiles
# that were best there on the H100 (2026-11-26, benchmarks/results/deterministic-tma-h100-20261126/):
# 128 x 128 up to M = 1024 (the four projections at M = 512: 1.18x cuBLAS's time, against 1.55x
# with pointer loads and 128 x 256 tiles) and 128 x 256 above (1.01x at M = 2048, against 1.22x).
# The decode bucket's stages (8, was 6) and its narrow variant are from the CUDA-graph sweep of
# 2026-11-26 (benchmarks/deterministic_kernels.py --part small, deterministic-h100-20261126b/).
_BF16_BUCKETS = ((64, (64, 64, 64, 8, 4, 8)), (1024, (128, 128, 64, 8, 4, 4)), (None, (128, 256, 64, 8, 8, 3)))
# A weight whose 64-wide column tiles number at most half the SMs (Llama-3-8B's o and down: 64
# tiles for 132 SMs) leaves SMs idle in the decode bucket; 32-wide tiles (deeper pipeline: the
# tile is half the bytes) fill them: M = 1, o 16.1 -> 13.9 us, down 54.9 -> 43.7 us (cuBLAS 10.9
# and 44.3). BLOCK_N never changes a row's sums (the K loop is the bucket's).
_BF16_NARROW = (64, 32, 64, 8, 4, 12)
# Steps of at most 16 rows (batch-1 decode, the last miss) take tiles of their own, from
# `benchmarks/deterministic_kernels.py --part decode` on the H100 (2026-11-26, M = 1, under CUDA
# graphs, benchmarks/results/deterministic-decode-h100-20261126/): every candidate there, BLOCK_K
# 128 and 256 and BLOCK_M 16 (Triton's mma.sync instead of wgmma) included, gave rows bitwise
# equal to the 2048-row prefill bucket's (tests/kernels/test_deterministic.py checks rows at
# M = 1 and 5 against M = 2048 on the GPU). The matrix units add each k16 slice into the fp32
# accumulator in k order whatever the tile: BLOCK_K and BLOCK_M change the loop, not the sums.
# Two rounds of candidates; the second's winner, 16 x 32 tiles 256 deep in 6 stages, for the
# narrow weights (o, down) and gate_up (at least two 64-wide tiles per SM): o 13.4 -> 9.1 us,
# down 43.6 -> 41.9, gate_up 88.1 -> 82.0 (cuBLAS 11.0, 44.5, 81.6). qkv keeps the bucket's
# (20.0 us, the best measured; 22.8 in these tiles). The LM head's 16 x 64 x 256 in 5 stages is
# within 1% of them (342.8 us against 345.3): one tile for all but the qkv-like middle.
BATCH1_MAX_M = 16
_BF16_BATCH1 = (16, 32, 256, 8, 4, 6)
BATCH1_CONFIGS = {torch.bfloat16: _BF16_BATCH1, torch.float16: _BF16_BATCH1}
# TMA loads from this M up, where tma_usable: at M = 64 they were slower than the 64 x 64 pointer
# tiles (qkv 0.040 against 0.032 ms), at 512 and 2048 faster for every projection.
TMA_MIN_M = 65
MATMUL_BUCKETS = {
    torch.bfloat16: _BF16_BUCKETS,
    torch.float16: _BF16_BUCKETS,
    torch.float32: ((None, (64, 64, 32, 8, 4, 3)),),
}
NARROW_DECODE_CONFIGS = {torch.bfloat16: _BF16_NARROW, torch.float16: _BF16_NARROW}
# Above the decode bucket each bucket has a second tile, 128 x 256 where it has 128 x 128 and
# back: which one is faster depends on how a weight's tiles fill the waves of the SMs (Llama-3-8B
# at M = 512: qkv 0.048 ms in 128 x 256 tiles against 0.060 in 128 x 128, o 0.045 against
# 0.037). _wave_cost picks one per shape; it ranked all 8 pairs measured on the H100 at M = 512
# and 2048 (deterministic-tma-h100-20261126/kernels-ef5c33e/) as they ran.
_BF16_ALTERNATIVES = {1024: (128, 256, 64, 8, 8, 4), None: (128, 128, 64, 8, 4, 4)}
ALTERNATIVE_CONFIGS = {torch.bfloat16: _BF16_ALTERNATIVES, torch.float16: _BF16_ALTERNATIVES}
SMALL_TILE_PENALTY = 1.15  # a 128 x 128 tile's MMA time per element against a 128 x 256 tile's
# Below it Triton picks another MMA instruction (mma.sync): measured to sum alike on the H100 only
# in BATCH1_CONFIGS's tiles (2026-11-26), which check_buckets does not cover.
MIN_BLOCK_M = 64
# The interpreter pays per operation, not per element: a small fixed shape keeps tests quick.
_INTERPRETER_CONFIG = (16, 32, 32, 4, 1, 1)


def check_buckets(buckets, narrow=None, alternatives=None) -> None:
    """One BLOCK_K per dtype (narrow decode tiles and alternatives included), BLOCK_M >=
    MIN_BLOCK_M, the last bucket open-ended."""
    for dtype, table in buckets.items():
        configs = [cfg for _, cfg in table] + ([narrow[dtype]] if narrow and dtype in narrow else [])
        configs += list((alternatives or {}).get(dtype, {}).values())
        if {cfg[2] for cfg in configs} != {table[0][1][2]} or table[-1][0] is not None:
            raise ValueError(f"{dtype}: buckets must share BLOCK_K and end with (None, config): {table}")
        if any(cfg[0] < MIN_BLOCK_M for cfg in configs):
            raise ValueError(f"{dtype}: BLOCK_M below {MIN_BLOCK_M} in {configs}")


check_buckets(MATMUL_BUCKETS, NARROW_DECODE_CONFIGS, ALTERNATIVE_CONFIGS)


def matmul_config(dtype: torch.dtype, m: int = 1, n: int = 0, sms: int = 0) -> tuple[int, int, int, int, int, int]:
    """The tile for an [m, K] x [K, n] product on a GPU of `sms` SMs (n, sms: 0 for the bucket's)."""
    if is_interpreter():
        return _INTERPRETER_CONFIG
    table = MATMUL_BUCKETS[dtype]
    max_m, config = next((max_m, cfg) for max_m, cfg in table if max_m is None or m <= max_m)
    if not n or not sms:
        return config
    narrow = NARROW_DECODE_CONFIGS.get(dtype)
    batch1 = BATCH1_CONFIGS.get(dtype)
    tiles = cdiv(n, config[1])
    if batch1 is not None and m <= BATCH1_MAX_M and (2 * tiles <= sms or tiles >= 2 * sms):
        return batch1  # narrow weights, and those with two or more 64-wide tiles per SM
    if narrow is not None and m <= table[0][0] and 2 * tiles <= sms:
        return narrow
    other = ALTERNATIVE_CONFIGS.get(dtype, {}).get(max_m)
    if other is not None and _wave_cost(other, m, n, sms) < _wave_cost(config, m, n, sms):
        return other
    return config


def _wave_cost(config: tuple[int, ...], m: int, n: int, sms: int) -> float:
    """Relative time of an [m, n] output in this config's tiles: waves of tiles over the SMs,
    times a tile's area, a 128 x 128 tile's at SMALL_TILE_PENALTY."""
    block_m, block_n = config[0], config[1]
    waves = cdiv(cdiv(m, block_m) * cdiv(n, block_n), sms)
    return waves * block_m * block_n * (1.0 if block_m * block_n >= 128 * 256 else SMALL_TILE_PENALTY)


def check_matmul_inputs(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> tuple[int, int]:
    """(N, K) of a batch-invariant matmul's weight, after checking x and bias against it."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be [N, K], got {tuple(weight.shape)}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x's last dim {x.shape[-1]} does not match weight's K {k}")
    if x.dtype != weight.dtype or x.dtype not in MATMUL_BUCKETS:
        raise TypeError(f"x and weight must share one of fp16, bf16, fp32; got {x.dtype}, {weight.dtype}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    return n, k


@functools.lru_cache(maxsize=None)
def _is_hopper_or_later(index: int) -> bool:
    """Asked once per device: tma_usable runs for every linear of every step."""
    return torch.cuda.get_device_capability(index)[0] >= 9


def tma_usable(x2: torch.Tensor, weight: torch.Tensor) -> bool:
    """TMA descriptors need 16-byte aligned bases and row strides (and a Hopper GPU, or the
    interpreter, which emulates them)."""
    if not is_interpreter() and (x2.device.type != "cuda" or not _is_hopper_or_later(x2.device.index or 0)):
        return False
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in (x2, weight))


def matmul_persistent(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                      out_dtype: Optional[torch.dtype] = None,
                      config: Optional[tuple[int, int, int, int, int, int]] = None,
                      tma: Optional[bool] = None) -> torch.Tensor:
    """y = x @ weight^T + bias with a summation order independent of x's row count.

    x [..., K]; weight [N, K]; bias [N]. Leading dims of x are flattened into M. config overrides
    the buckets (benchmarks/deterministic_tiles.py compares tile shapes); a caller that wants
    batch invariance must keep BLOCK_K and BLOCK_M >= MIN_BLOCK_M (check_buckets). tma: load the
    tiles through TMA descriptors where tma_usable (the same tiles and sums: the GPU tests check
    rows bitwise against the pointer loads); None: from TMA_MIN_M rows up, compiled only.
    """
    n, k = check_matmul_inputs(x, weight, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    check_last_dim_contiguous("weight", weight)
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m > 0 and n > 0:
        sms = num_sms(x.device.index or 0) if x.device.type == "cuda" else num_sms()
        config = config or matmul_config(x.dtype, m, n, sms)
        block_m, block_n, block_k, group_m, num_warps, num_stages = config[:6]
        num_tiles = cdiv(m, block_m) * cdiv(n, block_n)
        # A program per SM, or config[6] of them (a 7-tuple, for the benchmarks' candidates: tiles
        # too small to keep enough bytes in flight alone).
        programs = min(sms * (config[6] if len(config) > 6 else 1), num_tiles)
        common = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
                      HAS_BIAS=bias is not None, DOT_PRECISION=dot_precision(x.dtype),
                      UPCAST=upcast_dots(x.dtype), num_warps=num_warps, num_stages=num_stages)
        common.update(pdl_launch(x.device))
        if tma is None:
            tma = m >= TMA_MIN_M and not is_interpreter()
        if tma and tma_usable(x2, weight):
            from triton.tools.tensor_descriptor import TensorDescriptor

            x_desc = TensorDescriptor.from_tensor(x2, [block_m, block_k])
            w_desc = TensorDescriptor.from_tensor(weight, [block_n, block_k])
            _matmul_persistent_tma_kernel[(programs,)](
                y, x_desc, w_desc, bias if bias is not None else weight, m, n, k, programs, y.stride(0),
                **common)
        else:
            _matmul_persistent_kernel[(programs,)](
                y, x2, weight, bias if bias is not None else weight, m, n, k, programs,
                x2.stride(0), weight.stride(0), y.stride(0), **common)
    return y.reshape(*lead, n)


# --------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------

def matmul_ref(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
               out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """fp32 reference: the same product, summed by torch."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


def matmul_flops(m: int, n: int, k: int) -> int:
    return 2 * m * n * k


def matmul_bytes(m: int, n: int, k: int, elem_bytes: int, out_bytes: Optional[int] = None) -> int:
    """Each input read once and the output written once (the floor; tiles re-read x and W)."""
    return (m * k + n * k) * elem_bytes + m * n * (out_bytes or elem_bytes)
