"""Split-K for the weight-only GEMV/GEMM kernels: fp32 partial sums over K ranges, then one sum.

Why
---
At batch 1 a program owns BLOCK_N rows of W; for a narrow layer (o_proj: N = 4096, BLOCK_N = 16)
that is 256 programs on 132 SMs, too few bytes in flight per SM to reach HBM bandwidth. Splitting
K over SPLIT_K programs per row block multiplies the programs; each writes its fp32 partial
[M, N] to a workspace and this kernel adds the SPLIT_K partials in a fixed order and casts to
the output dtype (deterministic, unlike fp32 atomics, and one launch for the sum and the cast).

The kernels can also do that sum themselves, in the same order (w4a16.py; matmul_fixed_split.py's
"programs" schedule): the last of a tile's split programs to finish, told by an atomic counter per
output tile (tile_counters below), reads the partials back and writes y. That saves this launch.

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


# One int32 counter per output tile, per device, zero between launches (each launch's last programs
# reset theirs), shared by every kernel that sums its splits itself: launches on one stream never
# have counters in flight together (a PDL-launched kernel touches them only after its gdc_wait,
# when the kernel before has completed). Allocated on first use, which the engine's eager warm-up
# reaches before any CUDA graph capture.
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_MIN_COUNTERS = 4096
# Counters outgrown by a larger launch (an eager prefill after the decode graphs were captured):
# kept, never freed, because a captured graph still holds their address; freed, the allocator
# would hand that memory to other tensors that every replay's atomics would then corrupt.
_RETIRED: list[torch.Tensor] = []


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """At least `tiles` zeroed int32 counters on device (raises if growing them would allocate
    during CUDA graph capture: run the shape once eagerly first)."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < tiles:
        have = 0 if counters is None else counters.numel()
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"split-K needs {tiles} tile counters and has {have}: run the shape once "
                               "eagerly before capturing a CUDA graph")
        if counters is not None:
            _RETIRED.append(counters)
        counters = torch.zeros(max(tiles, 2 * have, _MIN_COUNTERS), dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters


def split_for(programs: int, iterations: int, sms: int) -> int:
    """The split-K pick_config takes without a measured table: about two programs per SM (at most
    8 ways, at least one K step each); programs is the count without split-K."""
    return max(1, min(8, iterations, -(-2 * sms // programs)))
