# The main-branch kernel as of b1dc42d (before the s9-w4 rewrite), kept verbatim as the sweep's 'old' baseline:
# benchmarks/quant_gemv_sweep.py times it beside the new one on the same GPU. Not used by rooflm.
"""W4A16: y = x @ W.T with W in 4-bit groups, dequantized as it is loaded, in Triton.

Why
---
Decode at small batch is weight-bandwidth-bound: every step streams every weight once. Four-bit
codes with one (scale, zero) pair per group of g weights read 4 + 32 * 2 / g bits a weight
(4.25 at g = 128) instead of bf16's 16, so the floor of a decode step drops ~3.8x. The weight is
never materialised in float: each tile is unpacked and scaled in registers just before the
multiply (the AWQ/GPTQ/Marlin idea; this kernel is the plain Triton version of it).

Layout (rooflm's runtime packing; checkpoints in AWQ/GPTQ order are repacked at load,
rooflm/quant/formats.py)
------
  qweight  uint8 [N, K / 2]   row n, byte j: code of k = 2j in the low nibble, k = 2j + 1 in
                              the high one. A row's codes are contiguous along K, so a program
                              that owns BLOCK_N rows reads BLOCK_N runs of BLOCK_K / 2 bytes:
                              coalesced, and unpacked with two mask/shift ops and one join.
  scales   [K / g, N]         float (the activation dtype), one per group and output row;
  zeros    [K / g, N]         float zero points in code units; group-major so that the BLOCK_N
                              values a tile needs are one contiguous load.
  w[n, k] = (code[n, k] - zeros[k // g, n]) * scales[k // g, n]

Algorithm
---------
Each program owns BLOCK_N output columns (rows of W) and BLOCK_M rows of x and walks K in tiles
of BLOCK_K (a multiple of g, so a tile holds BLOCK_K / g whole groups):
  - M == 1 (GEMV): the dequantized [BLOCK_N, BLOCK_K] tile times x broadcast, accumulated in
    fp32 elementwise and reduced over K once at the end (no tensor cores: one row of x);
  - M > 1 (GEMM): the tile is rounded to the activation dtype and fed to tl.dot with the
    [BLOCK_M, BLOCK_K] tile of x (tensor cores), fp32 accumulator.

Work
----
FLOPs 2 M N K. Bytes N K / 2 (codes) + 2 * 2 N K / g (scales, zeros) + 2 M K (x) + 2 M N (y).
At M <= 64 on an H100 the weight bytes dominate: the bound is bytes / ~3.0 TB/s.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from rooflm.kernels.utils import is_interpreter


# --------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------

@triton.jit
def _dequant_tile(qw_ptr, s_ptr, z_ptr, rn, n_mask, k0, N, K, GROUP: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] tile of W starting at column k0, in fp32."""
    rkh = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    packed = tl.load(qw_ptr + rn[:, None] * (K // 2) + rkh[None, :], mask=n_mask[:, None], other=0)
    low = (packed & 0xF).to(tl.float32)
    high = (packed >> 4).to(tl.float32)
    # join puts the pair last: element 2j is the low nibble, 2j + 1 the high one (the packing).
    codes = tl.join(low, high).reshape(BLOCK_N, BLOCK_K // GROUP, GROUP)
    rg = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
    sz_offs = rg[None, :] * N + rn[:, None]
    scale = tl.load(s_ptr + sz_offs, mask=n_mask[:, None], other=0.0).to(tl.float32)
    zero = tl.load(z_ptr + sz_offs, mask=n_mask[:, None], other=0.0).to(tl.float32)
    w = (codes - zero[:, :, None]) * scale[:, :, None]
    return w.reshape(BLOCK_N, BLOCK_K)


@triton.jit
def _w4a16_kernel(y_ptr, x_ptr, qw_ptr, s_ptr, z_ptr, M, N, K, stride_xm, stride_ym,
                  GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rk = tl.arange(0, BLOCK_K)
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            w = _dequant_tile(qw_ptr, s_ptr, z_ptr, rn, n_mask, k0, N, K, GROUP, BLOCK_N, BLOCK_K)
            x = tl.load(x_ptr + pid_m * stride_xm + k0 + rk).to(tl.float32)
            acc += w * x[None, :]
        y = tl.sum(acc, axis=1)
        tl.store(y_ptr + pid_m * stride_ym + rn, y.to(y_ptr.dtype.element_ty), mask=n_mask)
    else:
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = rm < M
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            w = _dequant_tile(qw_ptr, s_ptr, z_ptr, rn, n_mask, k0, N, K, GROUP, BLOCK_N, BLOCK_K)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :], mask=m_mask[:, None], other=0.0)
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PRECISION)
        offs = rm[:, None] * stride_ym + rn[None, :]
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# --------------------------------------------------------------------------
# Wrapper
# --------------------------------------------------------------------------

class W4Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def pick_config(m: int, n: int, k: int, group: int) -> W4Config:
    """Tiles by batch: one row of x streams through CUDA cores with narrow BLOCK_N (many programs
    for N = 4096 on 132 SMs); larger batches take tensor-core tiles of 16..64 rows of x."""
    block_k = max(group, 128) if k % max(group, 128) == 0 else group
    if m == 1:
        return W4Config(1, 16, max(block_k, 256) if k % max(block_k, 256) == 0 else block_k, 4, 3)
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 32 if m <= 16 else 64
    return W4Config(block_m, block_n, block_k, 4, 3)


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, config: Optional[W4Config] = None) -> torch.Tensor:
    """x [M, K] (fp16/bf16/fp32) @ W.T for W in the layout above; returns [M, N] in x's dtype.
    config: tiles to use instead of pick_config's (benchmarks sweep them)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    m, k = x.shape
    n = qweight.shape[0]
    if qweight.dtype != torch.uint8 or qweight.shape[1] * 2 != k:
        raise ValueError(f"qweight must be uint8 [N, K/2] = [{n}, {k // 2}], got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    if k % group_size or group_size % 16:
        raise ValueError(f"K={k} must be a multiple of the group size {group_size} (itself a multiple of 16)")
    groups = k // group_size
    if scales.shape != (groups, n) or zeros.shape != (groups, n):
        raise ValueError(f"scales and zeros must be [K/g, N] = [{groups}, {n}], got "
                         f"{tuple(scales.shape)} and {tuple(zeros.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    cfg = config or pick_config(m, n, k, group_size)
    if k % cfg.block_k or cfg.block_k % group_size or (cfg.block_m == 1) != (m == 1):
        raise ValueError(f"config {cfg} does not fit M={m} K={k} group {group_size}")
    grid = (triton.cdiv(n, cfg.block_n), m if cfg.block_m == 1 else triton.cdiv(m, cfg.block_m))
    _w4a16_kernel[grid](y, x, qweight, scales, zeros, m, n, k, x.stride(0), y.stride(0),
                        GROUP=group_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                        # fp32 activations multiply in full precision (tl.dot would take tf32)
                        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                        num_warps=cfg.num_warps, num_stages=1 if is_interpreter() else cfg.num_stages)
    return y


# --------------------------------------------------------------------------
# Packing and reference
# --------------------------------------------------------------------------

def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] in 0..15 -> uint8 [N, K / 2] (even k low nibble, odd k high)."""
    codes = codes.to(torch.uint8)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4."""
    return torch.stack([qweight & 0xF, qweight >> 4], dim=-1).reshape(qweight.shape[0], -1)


def dequantize_w4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  group_size: int) -> torch.Tensor:
    """W [N, K] in fp32 from the runtime layout."""
    codes = unpack_int4(qweight).float()
    s = scales.float().T.repeat_interleave(group_size, dim=1)
    z = zeros.float().T.repeat_interleave(group_size, dim=1)
    return (codes - z) * s


def w4a16_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     group_size: int) -> torch.Tensor:
    """Dequantize, then an fp32 matmul; the result in x's dtype."""
    return (x.float() @ dequantize_w4(qweight, scales, zeros, group_size).T).to(x.dtype)


def w4a16_bytes(m: int, n: int, k: int, group_size: int, act_bytes: int = 2) -> int:
    """Bytes one call must move: codes, scales and zeros, x and y."""
    return n * k // 2 + 2 * act_bytes * n * (k // group_size) + act_bytes * (m * k + m * n)
