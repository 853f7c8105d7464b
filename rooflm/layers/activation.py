"""The gated MLP's activation on a fused [T, 2I] input: silu(gate) * up, or gelu_tanh(gate) * up (Gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(torch.nn.Module):
    def __init__(self, kernel=None):
        super().__init__()
        self.kernel = kernel  # the Triton kernel on CUDA (layers/kernels.py), else torch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x)
        return silu_and_mul_torch(x)


class GeluTanhAndMul(torch.nn.Module):
    """gelu(gate, approximate="tanh") * up: Gemma's gated MLP (HF's gelu_pytorch_tanh). Torch only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
