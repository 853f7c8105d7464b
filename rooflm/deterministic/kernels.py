"""The batch-invariant kernel set the model runner passes to the model with --deterministic."""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F

from rooflm.layers.kernels import TORCH_KERNELS, Kernels


def triton_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  quant=None) -> torch.Tensor:
    """x @ weight^T + bias with one summation order for every M: the fixed-split matmul, whose
    split count follows the weight's shape (narrow projections split K to fill the SMs at decode
    sizes; the others are the persistent matmul's single K loop)."""
    from rooflm.kernels.matmul_fixed_split import matmul_fixed_split

    if quant is not None:
        raise ValueError("--deterministic on the GPU needs float weights (quantized layers run on the CPU only)")
    return matmul_fixed_split(x, weight, bias)


# The fused gate_up + SiLU-mul for steps of at most this many rows (the persistent matmul's
# decode bucket, where a launch and a round trip of [M, 2I] cost what they save); above it,
# the matmul then silu_mul, with the same bits (matmul_persistent_gated's docstring).
# ROOFLM_DETERMINISTIC_GATED_MAX_M=0 turns the fusion off (benchmarks/deterministic.sh compares).
GATED_MAX_M = int(os.environ.get("ROOFLM_DETERMINISTIC_GATED_MAX_M", "64"))


def triton_gated_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(x W_gate^T) * (x W_up^T) for the fused gate_up weight [2I, K], bitwise
    silu_mul(triton_linear(x, weight)) at every M."""
    from rooflm.kernels.matmul_fixed_split import split_plan
    from rooflm.kernels.matmul_persistent import matmul_persistent_gated
    from rooflm.kernels.silu_mul import silu_mul
    from rooflm.kernels.utils import num_sms

    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    # The fused kernel sums as the persistent matmul does: where the fixed split splits this
    # weight (ROOFLM_DETERMINISTIC_MAX_SPLITS), it is not the same order.
    if rows <= GATED_MAX_M and split_plan(*weight.shape, x.dtype, num_sms(x.device.index or 0))[0] == 1:
        return matmul_persistent_gated(x, weight)
    return silu_mul(triton_linear(x, weight).reshape(-1, weight.shape[0])).reshape(*x.shape[:-1], -1)


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                   quant=None) -> torch.Tensor:
    """The CPU's batch-invariant linear: each row is its own [1, K] product, so it goes through
    the same BLAS call (and the same sums) whether it is alone or one of a thousand rows. It is
    M calls instead of one: prefill on the CPU is several times slower in this mode."""
    rows = x.reshape(-1, x.shape[-1])
    out = []
    for i in range(rows.shape[0]):
        row = rows[i:i + 1]
        if quant is not None:
            y = quant(row)
            out.append(y if bias is None else y + bias)
        else:
            out.append(F.linear(row, weight, bias))
    y = torch.cat(out) if out else rows.new_empty(0, weight.shape[0] if quant is None else quant.out_features)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def deterministic_kernels(device_type: str) -> Kernels:
    """Batch-invariant kernels for the device: Triton on CUDA, row-at-a-time torch on the CPU."""
    if device_type == "cuda":
        from rooflm.kernels.rmsnorm import rmsnorm
        from rooflm.kernels.silu_mul import silu_mul

        return Kernels(rmsnorm=rmsnorm, silu_mul=silu_mul, gemv=None, linear=triton_linear, head_norm=rmsnorm,
                       gated_linear=triton_gated_linear)
    return Kernels(rmsnorm=TORCH_KERNELS.rmsnorm, silu_mul=None, gemv=None, linear=rowwise_linear)
