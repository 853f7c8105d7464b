"""RMSNorm, optionally fused with the residual add that precedes it.

HF semantics, which parity depends on: normalise in fp32, cast back to the
input dtype, then scale by the weight in the input dtype.
"""

from __future__ import annotations

from typing import Optional

import torch


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    fp32 = dtype == torch.float32  # then the casts are no-ops: skip their dispatch (CPU decode)
    xf = x if fp32 else x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (xf if fp32 else xf.to(dtype))


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float, kernel=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.kernel = kernel  # a fused Triton kernel on CUDA (layers/kernels.py), else torch

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if self.kernel is not None and x.dim() == 2:
            return self.kernel(x, self.weight, self.eps, residual)
        if self.kernel is not None and residual is None:  # q/k norms over heads (Kernels.head_norm)
            return self.kernel(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        if residual is None:
            return rms_norm_torch(x, self.weight, self.eps)
        residual = x + residual
        return rms_norm_torch(residual, self.weight, self.eps), residual


class OnePlusRMSNorm(torch.nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from 1, and the scale (1 + w) is
    applied in fp32 before the cast back (HF's Gemma2RMSNorm, whose casts parity depends on).
    No fused kernel: the Triton RMSNorm multiplies by w in the input dtype."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)
