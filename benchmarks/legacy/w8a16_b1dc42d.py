# The main-branch kernel as of b1dc42d (before the s9-w4 rewrite), kept verbatim as the sweep's 'old' baseline:
# benchmarks/quant_gemv_sweep.py times it beside the new one on the same GPU. Not used by rooflm.
"""W8A16: y = x @ W.T with W as int8 codes and one scale (and zero point) per output row, in Triton.

Why
---
Batch-1 decode streams every weight each step; int8 halves bf16's bytes (gpt-fast's int8
weight-only path: 173 -> 234 tokens/s on the project's H100). A per-channel scale factors out
of the sum over K, so the codes are multiplied as they are and scaled once in the epilogue:

    y[m, n] = s[n] * (sum_k x[m, k] q[n, k] - z[n] sum_k x[m, k])

The zero term is zero for symmetric checkpoints (rooflm's RTN, GPTQ sym); GPTQ's asymmetric
8-bit per-channel weights need it. int8 codes are exact in bf16/fp16 (|q| <= 128 < 2^8), so the
tensor-core path multiplies the exact codes.

Layout
------
  qweight int8 [N, K] (nn.Linear's row-major: a program's BLOCK_N rows are contiguous along K)
  scales  [N] float, zeros [N] float (code units)

Algorithm
---------
Each program owns BLOCK_N rows of W and BLOCK_M rows of x, walking K in BLOCK_K tiles:
M == 1 accumulates the [BLOCK_N, BLOCK_K] products in fp32 and reduces once (GEMV); M > 1 uses
tl.dot on codes converted to the activation dtype, fp32 accumulator.

Work
----
FLOPs 2 M N K. Bytes N K (codes) + 2 * 2 N (scale, zero) + 2 M K + 2 M N: the weight's bytes
dominate at decode batch sizes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from rooflm.kernels.utils import is_interpreter


# --------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------

@triton.jit
def _w8a16_kernel(y_ptr, x_ptr, qw_ptr, s_ptr, z_ptr, M, N, K, stride_xm, stride_ym,
                  HAS_ZERO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rk = tl.arange(0, BLOCK_K)
    scale = tl.load(s_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        xsum = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = (k0 + rk) < K
            q = tl.load(qw_ptr + rn[:, None] * K + (k0 + rk)[None, :],
                        mask=n_mask[:, None] & k_mask[None, :], other=0).to(tl.float32)
            x = tl.load(x_ptr + pid_m * stride_xm + k0 + rk, mask=k_mask, other=0.0).to(tl.float32)
            acc += q * x[None, :]
            if HAS_ZERO:
                xsum += x
        y = tl.sum(acc, axis=1)
        if HAS_ZERO:
            zero = tl.load(z_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
            y -= zero * tl.sum(xsum, axis=0)
        y *= scale
        tl.store(y_ptr + pid_m * stride_ym + rn, y.to(y_ptr.dtype.element_ty), mask=n_mask)
    else:
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = rm < M
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        xsum = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = (k0 + rk) < K
            q = tl.load(qw_ptr + rn[:, None] * K + (k0 + rk)[None, :],
                        mask=n_mask[:, None] & k_mask[None, :], other=0)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :],
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(q.to(x.dtype)), acc, input_precision=PRECISION)
            if HAS_ZERO:
                xsum += x.to(tl.float32)
        if HAS_ZERO:
            zero = tl.load(z_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
            acc -= tl.sum(xsum, axis=1)[:, None] * zero[None, :]
        acc *= scale[None, :]
        offs = rm[:, None] * stride_ym + rn[None, :]
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# --------------------------------------------------------------------------
# Wrapper
# --------------------------------------------------------------------------

class W8Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def pick_config(m: int, n: int, k: int) -> W8Config:
    """As w4a16.pick_config: narrow row blocks at M == 1, tensor-core tiles above."""
    if m == 1:
        return W8Config(1, 16, 256, 4, 3)
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    return W8Config(block_m, 32 if m <= 16 else 64, 128, 4, 3)


def w8a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W.T for int8 W [N, K] with per-row scales [N] (and zero points [N])."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    m, k = x.shape
    n = qweight.shape[0]
    if qweight.dtype != torch.int8 or qweight.shape[1] != k:
        raise ValueError(f"qweight must be int8 [N, K] with K={k}, got {qweight.dtype} {tuple(qweight.shape)}")
    if scales.shape != (n,) or (zeros is not None and zeros.shape != (n,)):
        raise ValueError(f"scales (and zeros) must be [N] = [{n}], got {tuple(scales.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    cfg = pick_config(m, n, k)
    grid = (triton.cdiv(n, cfg.block_n), m if cfg.block_m == 1 else triton.cdiv(m, cfg.block_m))
    _w8a16_kernel[grid](y, x, qweight, scales, scales if zeros is None else zeros, m, n, k,
                        x.stride(0), y.stride(0), HAS_ZERO=zeros is not None,
                        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=cfg.num_warps,
                        num_stages=1 if is_interpreter() else cfg.num_stages)
    return y


# --------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------

def dequantize_w8(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None) -> torch.Tensor:
    """W [N, K] in fp32."""
    codes = qweight.float()
    if zeros is not None:
        codes = codes - zeros.float()[:, None]
    return codes * scales.float()[:, None]


def w8a16_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     zeros: torch.Tensor | None = None) -> torch.Tensor:
    return (x.float() @ dequantize_w8(qweight, scales, zeros).T).to(x.dtype)


def w8a16_bytes(m: int, n: int, k: int, act_bytes: int = 2) -> int:
    return n * k + 2 * act_bytes * n + act_bytes * (m * k + m * n)
