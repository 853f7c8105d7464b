"""FP8 W8A8 matmul with row-wise scales: y = (sx sw^T) * (qx @ qw^T), persistent, TMA-fed, in Triton.

Why
---
torch._scaled_mm with row-wise scales runs torch's CUTLASS kernel, whose tile heuristic fits a
decode step's M badly: at M = 323 (Llama-3-8B, 1000 x 1024/1024 offline) qkv took 29.8 us (545
TFLOP/s) and gate_up 104.7 (725), where the same codes with per-tensor scales (cuBLAS) took 20.0
and 80.7 (benchmarks/results/fp8-matmul-h100-20261127/). This kernel keeps the row-wise
epilogue and lets the tile follow the shape: a persistent grid of one program an SM walks
[BLOCK_M, BLOCK_N] output tiles (grouped along M so neighbours share W tiles in L2), each
summing qx and qw tiles brought in by the Hopper TMA through fp8 wgmma into fp32.

Algorithm
---------
    acc[m, n] = sum_k qx[m, k] qw[n, k]          (fp8 x fp8 products, fp32 sums; BLOCK_K a step)
    y[m, n]   = bf16(acc[m, n] * sx[m] * sw[n])

Hopper's fp8 wgmma adds its products into the accumulator with fewer mantissa bits than fp32
(DeepSeek-V3's report: ~14); Triton chains the wgmmas over the whole K ("fast accumulation"),
as vLLM's CUTLASS FP8 kernels on sm90 do (their FP8FastAccum schedules). Promoting the partial
sum into a separate fp32 accumulator after each BLOCK_K slice (PROMOTE, _scaled_mm's default)
made every call wait on its wgmmas: at M = 323, qkv 23.5 -> 36.4 us, o 15.4 -> 25.7 (H100,
benchmarks/fp8_matmul.py), which gives the whole gain back; it stays a measured option. Tiles: 128 x 256 (8 warps) or 128 x 128 (4 warps),
128 deep; the one whose waves of tiles over the SMs cost least (matmul_persistent.py's
_wave_cost) is used.

Shapes
------
qx [M, K] float8_e4m3fn (row-major), sx [M] or [M, 1] fp32; qw [N, K] float8_e4m3fn (nn.Linear's
layout), sw [N] fp32; y [M, N] bf16. K and N multiples of 16 (TMA: 16-byte row strides).

Work
----
FLOPs 2 M N K. Bytes M K + N K + 2 M N + 4 (M + N): a decode step's M (hundreds) is near the
ridge (H100: ~1500 TFLOP/s fp8 measured against ~3 TB/s, ~500 FLOP/B), prefill chunks compute-bound.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from rooflm.kernels.matmul_persistent import _tile_coords, _wave_cost
from rooflm.kernels.utils import cdiv, is_interpreter, num_sms

FP8_DTYPE = torch.float8_e4m3fn


# --------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------

# M changes every step: not specialised on, so one compiled kernel serves every batch.
@triton.jit(do_not_specialize=["M", "num_programs"])
def _fp8_matmul_kernel(y_ptr, x_desc, w_desc, sx_ptr, sw_ptr, M, N, K, num_programs, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, PROMOTE: tl.constexpr = False):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, num_programs, flatten=True):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = x_desc.load([off_m, k0])
            b = w_desc.load([off_n, k0])
            if PROMOTE:  # each slice's sum added into fp32 (slower: the header)
                acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K)
            else:
                acc = tl.dot(a, b.T, acc)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        m_ok = offs_m < M
        n_ok = offs_n < N
        sx = tl.load(sx_ptr + offs_m, mask=m_ok, other=0.0)
        sw = tl.load(sw_ptr + offs_n, mask=n_ok, other=0.0)
        y = acc * sx[:, None] * sw[None, :]
        tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


# --------------------------------------------------------------------------
# Wrapper
# --------------------------------------------------------------------------

class Fp8MatmulConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


# The two tiles that won on the H100 across Llama-3-8B's four shapes at M 256-2048
# (benchmarks/results/fp8-matmul-h100-20261127/).
WIDE = Fp8MatmulConfig(128, 256, 128, 8, 8, 3)
SQUARE = Fp8MatmulConfig(128, 128, 128, 8, 4, 4)
# Below this M, _scaled_mm (the kernel was not measured there).
MIN_M = 256
# ROOFLM_FP8_TRITON_MM=0: every FP8 W8A8 product on torch._scaled_mm (the A/B switch).
ENABLED = os.environ.get("ROOFLM_FP8_TRITON_MM", "1") != "0"


def pick_config(m: int, n: int, sms: int) -> Fp8MatmulConfig:
    """The tile whose waves over the SMs cost least (matmul_persistent's _wave_cost: a 128 x 128
    tile's elements at 1.15x a 128 x 256 tile's)."""
    return min((WIDE, SQUARE), key=lambda cfg: _wave_cost(cfg, m, n, sms))


def fp8_matmul_usable(qx: torch.Tensor, qw: torch.Tensor) -> bool:
    """Where this kernel takes the product: ENABLED, a Hopper GPU (TMA, fp8 wgmma), M >= MIN_M, and
    shapes TMA takes (16-byte aligned rows and bases)."""
    if not ENABLED or is_interpreter() or qx.device.type != "cuda" or qx.shape[0] < MIN_M:
        return False
    if torch.cuda.get_device_capability(qx.device)[0] != 9:
        return False
    return all(t.stride(-1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0 for t in (qx, qw))


def fp8_matmul(qx: torch.Tensor, sx: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor,
               config: Optional[Fp8MatmulConfig] = None, promote: bool = False) -> torch.Tensor:
    """bf16 y [M, N] = (qx * sx) @ (qw * sw)^T for E4M3 codes qx [M, K], qw [N, K] and fp32 scales
    sx [M] (or [M, 1]), sw [N]. config: tiles to use instead of pick_config's; promote: sums
    promoted to fp32 each BLOCK_K slice (both for benchmarks; the header)."""
    if qx.dtype != FP8_DTYPE or qw.dtype != FP8_DTYPE:
        raise TypeError(f"fp8_matmul takes float8_e4m3fn codes; got {qx.dtype} and {qw.dtype}")
    m, k = qx.shape
    n = qw.shape[0]
    if qw.shape[1] != k or sx.numel() != m or sw.numel() != n:
        raise ValueError(f"fp8_matmul shapes: qx {tuple(qx.shape)}, sx {tuple(sx.shape)}, qw {tuple(qw.shape)}, "
                         f"sw {tuple(sw.shape)}")
    y = torch.empty(m, n, dtype=torch.bfloat16, device=qx.device)
    if m == 0:
        return y
    from triton.tools.tensor_descriptor import TensorDescriptor
    sms = num_sms(qx.device.index or 0)
    cfg = config or pick_config(m, n, sms)
    programs = min(sms, cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n))
    x_desc = TensorDescriptor.from_tensor(qx, [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor.from_tensor(qw, [cfg.block_n, cfg.block_k])
    _fp8_matmul_kernel[(programs,)](
        y, x_desc, w_desc, sx.reshape(-1).float().contiguous(), sw.reshape(-1).float().contiguous(), m, n, k, programs, y.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        PROMOTE=promote, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


# --------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------

def fp8_matmul_ref(qx: torch.Tensor, sx: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """The product in fp32 (not rounded to bf16): every e4m3 value and every product of two is exact
    in fp32, so only the sum's order differs from the kernel's, then its bf16 rounding."""
    return (qx.float() @ qw.float().T) * sx.float().reshape(-1, 1) * sw.float().reshape(1, -1)
