"""W4A16 at M <= 8 on mma.sync: the hand-written CUDA kernel csrc/w4a16_mma.cu, compiled by NVRTC.

Why
---
At batch 1 the Triton W4 kernels (w4a16.py) stream the 8B shapes at 1.0-1.6 TB/s against the
H100's ~3 TB/s (benchmarks/results/quant-w4-ncu-h100-20261127): the per-weight GEMV issues ~7
instructions a weight and is issue-bound; the swap-AB tensor-core tiles hold 157 registers a
thread, 3 CTAs an SM, and are latency-bound. Neither is fixed by tiles, split-K, register caps or
fusion (all measured). Both need control of register layouts that Triton does not give. This
kernel takes it:
  - the weight is the A operand of mma.sync.m16n8k16 and x is B (its first M of 8 columns), so
    the multiply-adds cost one tensor instruction for 256 weights;
  - a shift and one lop3 turn two codes into two 16-bit (1 + code / 16), exact, straight into A's
    registers (~1 instruction a weight with x's prmt), because the k order inside an MMA is free:
    x's B fragment is built in the order the codes come in (csrc/w4a16_mma.cu's header);
  - one block owns 16 x tiles rows of W; its warps split K by whole groups and each keeps groups of
    codes in flight, either depth groups in registers (16-byte loads that skip L1) or stages - 1
    groups with their scales through cp.async into shared memory (Marlin's pipeline: no registers
    held for loads in flight; the wide shapes' choice); the warps' partials are summed in shared
    memory in a fixed order: no workspace, no atomics, one launch.
  - scale and zero apply once per group and row to the fp32 MMA results:
    16 s sum(w' x) - s (16 + z) sum(x), sum(x) from an MMA with an A of ones.
  - gated (the MLP's gate_up): a block's rows are half gate rows and the same up rows, so a
    thread's two rows of a tile are a gate and its up, and silu(gate) * up is the epilogue.

H100, Llama-3-8B shapes at M = 1: 1.2-1.5x faster than the Triton tiles (qkv 11.3 -> 8.7 us, o 9.2 ->
6.7, gate_up 38.3 -> 28.7, down 22.5 -> 15.6, LM head 147 -> 101); int4 batch-1 decode 308 -> 418
tok/s with the gated epilogue (benchmarks/results/quant-w4-mma-h100-20261127).

Work: as w4a16.py (the same layout and bytes). Reference: w4a16.w4a16_linear_ref (gated: silu_mul of it).

Limits (else the caller uses w4a16.py): CUDA sm_80+, bf16/fp16 x, M <= 8, K == 2 S (no padded
groups), the group a multiple of 64, 16-byte aligned rows. NVRTC compiles a variant in ~1 s on
first use (torch.cuda._compile_kernel: no nvcc, no C++ toolchain needed).
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple, Optional

import torch

import rooflm.envs as envs
from rooflm.kernels import nvrtc
from rooflm.kernels.tuned_configs import lookup
from rooflm.kernels.int4_pack import int4_split

log = logging.getLogger(__name__)
MAX_M = 8  # the MMA's N: columns of B
# Where a block releases the next kernel (csrc/w4a16_mma.cu RELEASE): 0 its end, 1 its start, 2 after
# its main loop (before the warps' sum and the store). H100 int4 batch-1 decode, with SiLU-mul in
# gate_up's epilogue (so gate_up -> down is W4 to W4): 416.8 / 410.7 tok/s at 0, 415.4 / 415.0 at 1,
# 419.2 / 418.6 at 2 (benchmarks/results/quant-w4-mma-h100-20261127/release-call8).
# ROOFLM_W4_MMA_RELEASE: the benchmarks' switch (default 2).


class MmaConfig(NamedTuple):
    warps: int = 4   # a block's warps: they split the block's rows' K by whole groups
    depth: int = 2   # groups of codes each warp keeps in flight
    tiles: int = 1   # 16-row tiles a warp multiplies (x's loads and B fragments shared by them)
    stages: int = 0  # 0: depth groups in flight in registers; >= 2: cp.async through shared memory,
    #                  stages - 1 groups in flight a warp (needs N % (16 tiles) == 0, else 0 is used)


def shared_bytes(config: MmaConfig, group: int, norm_k: int = 0) -> int:
    """Dynamic shared memory of a launch: per warp and stage, each lane's 2 tiles x group / 64
    16-byte code chunks and 8 tiles chunks of scales and zeros (csrc/w4a16_mma.cu); norm_k: the
    normalized row of a NORM launch after them (K 16-bit values)."""
    stages = config.warps * config.stages * (2 * config.tiles * (group // 64) * 32 + 8 * config.tiles) * 16
    return stages + 2 * norm_k


def supported(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, k: int,
              group_size: int) -> bool:
    """Whether this kernel takes the call (else w4a16.py's Triton kernels do). Scales and zeros must
    come in x's dtype: GGUF's fp16/fp32 ones (kept exact at load) go to Triton, which reads any float,
    rather than being rounded and copied on every call."""
    if not (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2):
        return False
    if scales.dtype != x.dtype or zeros.dtype != x.dtype:
        return False
    if x.shape[0] > MAX_M or group_size % 64 or k != 2 * int4_split(k, group_size):
        return False
    if x.stride(-1) != 1 or (x.stride(0) * 2) % 16 or x.data_ptr() % 16 or qweight.data_ptr() % 16:
        return False
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return _compiles(index)


@functools.lru_cache(maxsize=None)
def _compiles(device_index: int) -> bool:
    """sm_80+ and NVRTC at hand (torch.cuda._compile_kernel, a private torch API): one small variant
    compiles, once a device. Otherwise w4a16.py's Triton kernels serve every M, with one warning."""
    if not nvrtc.available(device_index):
        return False
    try:
        _compiled(MmaConfig(), 64, False, False, envs.cached.ROOFLM_W4_MMA_RELEASE, device_index)
    except Exception as e:  # noqa: BLE001 - any NVRTC/driver failure means: use Triton
        log.warning("w4a16_mma: NVRTC could not build the kernel (%s); int4 at M <= 8 uses the Triton kernels", e)
        return False
    return True


@functools.lru_cache(maxsize=256)
def pick_config(m: int, n: int, k: int, group: int, device_name: Optional[str] = None) -> MmaConfig:
    """The measured config of rooflm/kernels/tuned/weight_only.json ("w4a16_mma", written by
    benchmarks/w4_mma_sweep.py --table) for this GPU and shape, else a heuristic from the H100's
    first sweep: wide N (>= 1024 tiles) two tiles a warp; N <= 4096 eight warps splitting K."""
    tabled = lookup("w4a16_mma", device_name, n, k, m, group)
    if tabled is not None:
        return MmaConfig(**tabled)
    if n // 16 >= 1024:
        return MmaConfig(4, 1, 2)
    if n <= 4096:
        return MmaConfig(8, 1, 1)
    return MmaConfig(4, 2, 1)


@functools.lru_cache(maxsize=None)
def _compiled(config: MmaConfig, group: int, fp16: bool, pdl: bool, release: int, device_index: int,
              gated: bool = False, norm_k: int = 0, residual: bool = False):
    defines = {"RELEASE": release, "GATED": gated, "WARPS": config.warps, "GROUP": group, "DEPTH": config.depth,
               "TILES": config.tiles, "STAGES": config.stages, "FP16": fp16, "PDL": pdl, "NORM": norm_k > 0,
               "NORM_K": norm_k, "RESIDUAL": residual}
    return nvrtc.compile_kernel("w4a16_mma.cu", "w4a16_mma", defines, device_index,
                                shared_bytes(config, group, norm_k))


def w4a16_mma(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              group_size: int, config: MmaConfig = MmaConfig(), pdl: bool = False, gated: bool = False,
              norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6,
              residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M <= 8, K] @ W.T for W in w4a16.py's layout, [M, N] in x's dtype. gated: W is the gated
    MLP's gate_up [2I, K] (gate rows, then up rows) and the result is silu(gate) * up [M, I]
    (silu_mul.py's casts), gate_up never written; I must be a multiple of 8 tiles. norm_weight [K]
    (M = 1 only): x is the residual stream and the product is W @ rmsnorm(x) (rmsnorm_ref's casts).
    residual [M, N] (not gated): residual + W x, the product rounded first. The caller checks
    supported(); shapes are checked here."""
    m, k = x.shape
    n, split = qweight.shape
    if m > MAX_M:
        raise ValueError(f"w4a16_mma takes M <= {MAX_M}, got M={m}")
    if k != 2 * split or scales.shape != (k // group_size, n) or zeros.shape != scales.shape:
        raise ValueError(f"w4a16_mma: K={k} needs qweight [N, K/2] and scales/zeros [K/g, N], got "
                         f"{tuple(qweight.shape)}, {tuple(scales.shape)}, {tuple(zeros.shape)}")
    rows_a_block = 16 * config.tiles  # of W; gated: half gate, half up
    if gated and n % (2 * 8 * config.tiles):
        raise ValueError(f"w4a16_mma gated: gate_up's {n} rows must be 2 x a multiple of {8 * config.tiles}")
    if scales.dtype != x.dtype or zeros.dtype != x.dtype:
        raise ValueError(f"w4a16_mma: scales and zeros must be in x's dtype {x.dtype}, got {scales.dtype}, {zeros.dtype}")
    out = n // 2 if gated else n
    if norm_weight is not None and (m != 1 or norm_weight.shape != (k,) or norm_weight.dtype != x.dtype
                                    or not norm_weight.is_contiguous() or norm_weight.data_ptr() % 16 or k % 8):
        raise ValueError(f"w4a16_mma norm: one row, a contiguous [{k}] weight in {x.dtype} and K % 8 == 0, got "
                         f"M={m}, {tuple(norm_weight.shape)} {norm_weight.dtype}")
    if residual is not None and (gated or residual.shape != (m, out) or residual.dtype != x.dtype
                                 or residual.stride(-1) != 1):
        raise ValueError(f"w4a16_mma residual: [{m}, {out}] in {x.dtype}, last dim contiguous, not gated; got "
                         f"{tuple(residual.shape)} {residual.dtype}")
    y = torch.empty(m, out, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    if config.stages and (n % rows_a_block or scales.data_ptr() % 16 or zeros.data_ptr() % 16):
        config = config._replace(stages=0)  # the staged copy of scales reads whole aligned 8-row runs
    norm_k = k if norm_weight is not None else 0
    kernel = _compiled(config, group_size, x.dtype == torch.float16, pdl, envs.cached.ROOFLM_W4_MMA_RELEASE,
                       x.device.index if x.device.index is not None else torch.cuda.current_device(), gated,
                       norm_k, residual is not None)
    args = [y, x, qweight, scales.contiguous(), zeros.contiguous(), m, n, split, x.stride(0), y.stride(0),
            norm_weight if norm_weight is not None else x, float(eps),
            residual if residual is not None else y, residual.stride(0) if residual is not None else 0]
    grid, block = -(-n // rows_a_block), 32 * config.warps
    nvrtc.launch(kernel, grid, block, shared_bytes(config, group_size, norm_k), args, pdl)
    return y
