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

    @property
    def fused_weight(self) -> torch.Tensor:
        """The w of w * norm(x), as the fused kernels take it (they fold the norm into a GEMV,
        a quantized linear or an FP8 quantizer)."""
        return self.weight

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if self.kernel is not None and x.dim() == 2:
            return self.kernel(x, self.fused_weight, self.eps, residual)
        if self.kernel is not None and residual is None:  # q/k norms over heads (Kernels.head_norm)
            return self.kernel(x.reshape(-1, x.shape[-1]), self.fused_weight, self.eps).view(x.shape)
        if residual is None:
            return self.norm_torch(x)
        residual = x + residual
        return self.norm_torch(residual), residual

    def add_to(self, x: torch.Tensor, addend: torch.Tensor) -> torch.Tensor:
        """addend + norm(x): a post-norm and the residual add after it (one kernel on CUDA)."""
        if self.kernel is not None and x.dim() == 2:
            return self.kernel(x, self.fused_weight, self.eps, post_add=addend)
        return addend + self.norm_torch(x)

    def norm_torch(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_torch(x, self.weight, self.eps)


class OnePlusRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is stored as an offset from 1, and the scale (1 + w) is
    applied in fp32 before the cast back (HF's Gemma2RMSNorm, whose casts the torch path keeps).
    The fused kernels take (1 + w) in fp32 as their weight (fused_weight, derived once at load):
    they round the normalised value to the input dtype before the product, one rounding more
    than HF's, within bf16's noise."""

    def __init__(self, hidden_size: int, eps: float, kernel=None):
        super().__init__(hidden_size, eps, kernel)
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
        self.register_buffer("_fused_weight", torch.ones(hidden_size, dtype=torch.float32), persistent=False)

    @property
    def fused_weight(self) -> torch.Tensor:
        return self._fused_weight

    def finish_loading(self) -> None:
        """(1 + w) in fp32, written in place: CUDA graphs captured before a reload keep reading it."""
        with torch.no_grad():
            self._fused_weight.copy_(1.0 + self.weight.float())

    def norm_torch(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)
