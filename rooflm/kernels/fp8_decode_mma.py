"""Paged decode attention over an FP8 cache with static scales, on mma.sync: the hand-written CUDA
kernel csrc/fp8_decode_attention.cu, compiled by NVRTC (kernels/nvrtc.py).

Why
---
The Triton decode kernel (decode_attention.py) streams a bf16 cache at ~2.9 TB/s on the H100 but an
FP8 one at only 1.7-2.1 TB/s (benchmarks/results/kv-fp8-tiles-h100-20261126): widening E4M3 for its
dots goes through byte-wise shared-memory loads (179 LDS a tile against bf16's 49 LDSM) and their
address arithmetic, and no tile changes that. The FP8 offline workload's decode steps spend most of
their time there. This kernel controls the register layouts instead:
  - K is the A operand of mma.sync.m16n8k16 (16 keys) and q^T the B operand (8 columns: a GQA group
    of up to 8 heads), so the GQA group wastes at most half the MMA, not 3/4 of a 16-row tile;
  - the k order inside an MMA is free, so each lane's K bytes are two 16-byte runs loaded straight
    from global memory into registers and widened by cvt.f16x2.e4m3x2 into A's registers, no shared
    memory; V^T is the A operand of O^T += V^T P^T with its rows (dims) permuted so that a lane's V
    bytes are 16-byte runs too, and one prmt per pair makes the (key, key) pairs;
  - P moves from S^T's accumulator layout to P^T's B fragment in four shuffles a chunk;
  - each warp takes 16-key chunks in turn, keeps depth chunks in flight in registers, and the warps'
    softmax states are combined once in shared memory.
Split-KV partials use decode_attention.py's format and reduce kernel.

Shapes and reference: decode_attention.py (static FP8: k/v scale [H_kv] fp32; K's joins the softmax
scale, V's multiplies the output); decode_attention_ref is the reference.

Limits (else decode_attention.py's Triton kernel serves the call): CUDA sm_89+ (cvt.e4m3x2),
NVRTC at hand, static scales, head_dim 128, a GQA group of at most 8, no sliding window, cache
blocks of >= 16 keys, a contiguous [num_blocks, block_size, H_kv, 128] cache.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple, Optional

import torch

import rooflm.envs as envs
from rooflm.kernels import nvrtc

log = logging.getLogger(__name__)
HEAD_DIM = 128
MAX_GROUP = 8  # the MMA's N: columns of q^T
CHUNK = 16  # keys an MMA covers


class Fp8DecodeConfig(NamedTuple):
    warps: int = 4   # a block's warps: they take the split's 16-key chunks in turn
    depth: int = 2   # chunks of K and V each warp keeps in flight in registers
    minb: int = 1    # __launch_bounds__' blocks an SM (caps the registers)
    stages: int = 0  # 0: depth chunks in flight in registers; >= 2: cp.async into stages chunk
    #                  buffers of shared memory a warp (stages - 1 in flight, no registers held)
    heads_fast: int = 1  # grid (H_kv, seqs, splits): a sequence's KV heads read each cache row together


def shared_bytes(config: Fp8DecodeConfig, group: int) -> int:
    """Dynamic shared memory of a launch: each warp's stage buffers (a chunk's K and V, 4 KB), which
    also hold its combine record (o [group, 128] fp32, m and l) after its loop."""
    if not config.stages:
        return 0
    return config.warps * max(config.stages * 2 * CHUNK * HEAD_DIM, 4 * (group * HEAD_DIM + 16))


def _default_config() -> Fp8DecodeConfig:
    """(4, 1, 4, 2, 1) from the H100 sweeps at block 64 (benchmarks/kv_fp8.py; us, GB/s of K/V):
    300 x 1500 keys 329.5 (2,797) against 354.2 for the register ring (4, 1, 1) and 369.4 for the
    Triton kernel; 323 sequences of 1024..2047 keys 368.3 (2,805); 512 x 330 150.7. Two cp.async
    stages a warp at 128 registers hold 4 blocks an SM; the heads-fast grid is worth 4-5% over
    (sequences, heads). ROOFLM_FP8_DECODE_CONFIG="w,d,m,s,h" overrides (the benchmarks' switch)."""
    env = envs.get("ROOFLM_FP8_DECODE_CONFIG")
    return Fp8DecodeConfig(*env) if env else Fp8DecodeConfig(4, 1, 4, 2, 1)


DEFAULT_CONFIG = _default_config()


def supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              k_scale: Optional[torch.Tensor], sliding: bool) -> bool:
    """Whether this kernel takes the decode (else the Triton kernel does)."""
    # ROOFLM_FP8_DECODE_MMA=0: the Triton kernel for every FP8 decode (the benchmarks' A/B switch).
    if not (envs.cached.ROOFLM_FP8_DECODE_MMA and q.is_cuda and k_scale is not None and k_scale.dim() == 1 and not sliding):
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or k_cache.dtype != torch.float8_e4m3fn:
        return False
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if head_dim != HEAD_DIM or num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        return False
    if block_size < CHUNK or block_size & (block_size - 1):
        return False
    if v_cache.dtype != k_cache.dtype or v_cache.stride() != k_cache.stride():
        return False
    for cache in (k_cache, v_cache):
        if cache.stride(3) != 1 or cache.stride(2) != HEAD_DIM or cache.stride(1) % 16 or cache.data_ptr() % 16:
            return False
    if q.stride(2) != 1 or (q.stride(1) * 2) % 16 or (q.stride(0) * 2) % 16 or q.data_ptr() % 16:
        return False
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    return _compiles(index)


@functools.lru_cache(maxsize=None)
def _compiles(device_index: int) -> bool:
    """sm_89+ and NVRTC at hand: one variant compiles, once a device. Otherwise the Triton kernel
    serves FP8 decode, with one warning."""
    if not nvrtc.available(device_index) or torch.cuda.get_device_capability(device_index) < (8, 9):
        return False
    try:
        _compiled(DEFAULT_CONFIG, 4, False, False, device_index)
    except Exception as e:  # noqa: BLE001 - any NVRTC/driver failure means: use Triton
        log.warning("fp8_decode_mma: NVRTC could not build the kernel (%s); FP8 decode uses the Triton kernel", e)
        return False
    return True


@functools.lru_cache(maxsize=None)
def _compiled(config: Fp8DecodeConfig, group: int, fp16: bool, pdl: bool, device_index: int):
    defines = {"WARPS": config.warps, "DEPTH": config.depth, "MINB": config.minb, "STAGES": config.stages,
               "HEADS_FAST": config.heads_fast, "GROUP": group, "FP16": fp16, "PDL": pdl}
    return nvrtc.compile_kernel("fp8_decode_attention.cu", "fp8_decode_attention", defines, device_index,
                                shared_bytes(config, group))


def fp8_decode_attention_mma(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             k_scale: torch.Tensor, v_scale: torch.Tensor, block_tables: torch.Tensor,
                             seq_lens: torch.Tensor, query_start_loc: torch.Tensor, qk_scale: float,
                             num_seqs: int, num_splits: int, part_out: torch.Tensor, part_lse: torch.Tensor,
                             pdl: bool, config: Fp8DecodeConfig = DEFAULT_CONFIG) -> None:
    """The first kernel of decode_attention for a call supported() takes: writes out (one split) or
    the split partials part_out [num_seqs, H, splits, 128] / part_lse [num_seqs, H, splits] that
    decode_attention.py's reduce kernel combines. qk_scale is the softmax scale times log2(e)."""
    num_heads = q.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t.dtype != torch.int32:
            raise ValueError(f"fp8_decode_mma: {name} must be int32, got {t.dtype}")
    if num_splits > 1 and part_out.shape[-1] != HEAD_DIM:
        raise ValueError(f"fp8_decode_mma: partials need {HEAD_DIM} dims, got {tuple(part_out.shape)}")
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    kernel = _compiled(config, group, q.dtype == torch.float16, pdl, index)
    args = [out, part_out, part_lse, q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens,
            query_start_loc, float(qk_scale), num_splits, num_heads, q.stride(0), q.stride(1),
            out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0), block_size.bit_length() - 1]
    grid = (num_kv_heads, num_seqs, num_splits) if config.heads_fast else (num_seqs, num_kv_heads, num_splits)
    nvrtc.launch(kernel, grid, 32 * config.warps, shared_bytes(config, group),
                 args, pdl)
