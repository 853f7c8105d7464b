"""The default mode's linear for steps of 2 to 16 rows: the persistent matmul's batch-1 tiles where
they beat cuBLAS, torch's F.linear everywhere else.

Why
---
A step of 2-16 rows (a speculative verify forward of 1 + k tokens, a decode batch of a few
sequences) reads every weight once, like batch 1, but misses the one-token fused GEMV, so each
linear goes to cuBLAS. On the H100 (Llama-3-8B shapes, M = 16, under CUDA graphs;
benchmarks/results/deterministic-decode-h100-20261126/round2-9f549d6/) matmul_persistent's
16 x 32 x 256 tiles (BATCH1_CONFIGS) read the down projection in 42.5 us against cuBLAS's 45.5
and the LM head in 352 against 379, but lose on o (9.4 against 9.2) and gate_up (83.8 against
82.8) and tie on qkv. So only the shapes that won take them: deep weights (K >= 2 N, like down) and
wide ones (N >= 16 K, like an LM head). At 32 layers that is about 0.12 ms a step.

Numerics: a row's sums follow the tile, not the batch, so a step's rows are the same whether the
step is replayed from a CUDA graph or run eagerly (both call this function with the same M).
ROOFLM_SMALL_M_TILES=0 sends every shape to F.linear; =all sends every shape to the tiles (an
experiment: in a graph the Triton kernels chain by programmatic dependent launch, cuBLAS's do not).

Reference: F.linear (torch.nn.functional.linear); tests/kernels/test_small_m_linear.py.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F

from rooflm.kernels.matmul_persistent import BATCH1_MAX_M, matmul_persistent

SMALL_M_TILES = os.environ.get("ROOFLM_SMALL_M_TILES", "1") != "0"
ALL_SHAPES = os.environ.get("ROOFLM_SMALL_M_TILES", "1") == "all"
MIN_ROWS = 2  # one row takes the fused GEMV, where the model has it


def prefers_tiles(n: int, k: int) -> bool:
    """Whether a [N, K] weight is one of the shapes the batch-1 tiles read faster than cuBLAS."""
    return ALL_SHAPES or k >= 2 * n or n >= 16 * k


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                   quant=None) -> torch.Tensor:
    """x @ weight^T + bias (Kernels.linear's signature: quantized layers go to their method)."""
    if quant is not None:
        y = quant(x)
        return y if bias is None else y + bias
    rows = x.numel() // max(x.shape[-1], 1)
    if (SMALL_M_TILES and MIN_ROWS <= rows <= BATCH1_MAX_M and x.is_cuda and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and prefers_tiles(*weight.shape)):
        return matmul_persistent(x, weight, bias)
    return F.linear(x, weight, bias)
