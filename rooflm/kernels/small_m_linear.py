"""The default mode's linear for steps of 2 to 16 rows: the persistent matmul's batch-1 tiles,
torch's F.linear for every other step.

Why
---
A step of 2-16 rows (a speculative verify forward of 1 + k tokens, a decode batch of a few
sequences) reads every weight once, like batch 1, but misses the one-token fused GEMV, so each
linear went to cuBLAS. matmul_persistent's 16 x 32 x 256 tiles (BATCH1_CONFIGS) read the down
projection and an LM head faster than cuBLAS on the H100 (Llama-3-8B shapes, M = 16, each alone:
42.5 against 45.5 us, 352 against 379; benchmarks/results/deterministic-decode-h100-20261126/
round2-9f549d6/) and o, gate_up and qkv within 1% of it (9.4 against 9.2, 83.8 against 82.8, a
tie). Inside a step, all four win: the tiles launch with programmatic dependent launch, so every
kernel of a layer (norm, linears, RoPE, attention, SiLU-mul) starts while the one before drains,
and cuBLAS's kernels broke that chain three times a layer. Same call, H100, 2026-11-26: decode
TPOT at batch 4 6.20 -> 6.01 ms and at batch 16 6.56 -> 6.43 against the tiles on down and the
LM head only; the width-5 verify graph 6.10 -> 5.94 ms (benchmarks/results/spec-loop-h100-20261126/).

Numerics: a row's sums follow the tile, not the batch, so a step's rows are the same whether the
step is replayed from a CUDA graph or run eagerly (both call this function with the same M).
ROOFLM_SMALL_M_TILES=0 sends every shape to F.linear; =deep gives the tiles only the shapes that
won alone (K >= 2 N like down, N >= 16 K like an LM head), for A/B runs.

Reference: F.linear (torch.nn.functional.linear); tests/kernels/test_small_m_linear.py.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

import rooflm.envs as envs
from rooflm.kernels.matmul_persistent import BATCH1_MAX_M, matmul_persistent

MIN_ROWS = 2  # one row takes the fused GEMV, where the model has it


def prefers_tiles(n: int, k: int, deep_only: Optional[bool] = None) -> bool:
    """Whether a [N, K] weight takes the batch-1 tiles: every shape, or with deep_only the ones
    they read faster than cuBLAS alone (deep and wide weights). None: ROOFLM_SMALL_M_TILES=deep."""
    if deep_only is None:
        deep_only = envs.cached.ROOFLM_SMALL_M_TILES == "deep"
    return not deep_only or k >= 2 * n or n >= 16 * k


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                   quant=None) -> torch.Tensor:
    """x @ weight^T + bias (Kernels.linear's signature: quantized layers go to their method)."""
    if quant is not None:
        y = quant(x)
        return y if bias is None else y + bias
    rows = x.numel() // max(x.shape[-1], 1)
    if (envs.cached.ROOFLM_SMALL_M_TILES != "0" and MIN_ROWS <= rows <= BATCH1_MAX_M and x.is_cuda and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and prefers_tiles(*weight.shape)):
        return matmul_persistent(x, weight, bias)
    return F.linear(x, weight, bias)
