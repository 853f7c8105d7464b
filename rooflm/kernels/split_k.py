"""Split-K for the weight-only GEMV/GEMM kernels: fp32 partial sums over K ranges, then one sum.

Why
---
At batch 1 a program owns BLOCK_N rows of W; for a narrow layer (o_proj: N = 4096, BLOCK_N = 16)
that is 256 programs on 132 SMs, too few bytes in flight per SM to reach HBM bandwidth. Splitting
K over SPLIT_K programs per row block multiplies the programs; each writes its fp32 partial
[M, N] to a workspace and this kernel adds the SPLIT_K partials in a fixed order and casts to
the output dtype (deterministic, unlike fp32 atomics, and one launch for the sum and the cast).

Work
----
Reads 4 SPLIT_K M N bytes, writes 2 M N: small beside the weight (M N << N K at decode).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _split_k_reduce_kernel(y_ptr, ws_ptr, MN, SPLIT_K, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, SPLIT_K):
        acc += tl.load(ws_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def split_k_reduce(y: torch.Tensor, workspace: torch.Tensor) -> torch.Tensor:
    """y [M, N] (contiguous) = sum over dim 0 of workspace fp32 [SPLIT_K, M, N], in y's dtype."""
    split_k, m, n = workspace.shape
    if y.shape != (m, n) or not y.is_contiguous() or workspace.dtype != torch.float32:
        raise ValueError(f"split_k_reduce: y {tuple(y.shape)} must be contiguous [{m}, {n}] and the "
                         f"workspace fp32 [SPLIT_K, M, N], got {workspace.dtype}")
    block = 1024
    _split_k_reduce_kernel[(triton.cdiv(m * n, block),)](y, workspace, m * n, split_k, BLOCK=block, num_warps=4)
    return y


def split_for(programs: int, iterations: int, sms: int) -> int:
    """The split-K pick_config takes without a measured table: about two programs per SM (at most
    8 ways, at least one K step each); programs is the count without split-K."""
    return max(1, min(8, iterations, -(-2 * sms // programs)))
