"""The batch-invariant kernel set the model runner passes to the model with --deterministic."""

from __future__ import annotations

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

        return Kernels(rmsnorm=rmsnorm, silu_mul=silu_mul, gemv=None, linear=triton_linear, head_norm=rmsnorm)
    return Kernels(rmsnorm=TORCH_KERNELS.rmsnorm, silu_mul=None, gemv=None, linear=rowwise_linear)
