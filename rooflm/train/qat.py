"""Quantization-aware training: fake-quantized weights in the forward, fp32 master weights kept.

Every linear layer of the decoder blocks gets a parametrization (torch.nn.utils.parametrize)
that rounds its weight to a symmetric per-output-channel grid of int8 or int4 values and back
(scale = max |w| of the row / qmax), the weight-only format rooflm's int8/int4 CPU kernels run.
The backward is the straight-through estimator: rounding passes the gradient unchanged, so the
fp32 weights learn to sit where rounding costs least. Export drops the parametrization and writes
the fp32 weights; quantizing them afterwards reproduces what the forward saw.
"""

from __future__ import annotations

import torch
from torch.nn.utils import parametrize

QMAX = {"int8": 127, "int4": 7}


def fake_quantize(weight: torch.Tensor, bits: str) -> torch.Tensor:
    """Round weight [out, in] to the per-row symmetric grid and back, in weight's dtype."""
    qmax = QMAX[bits]
    scale = weight.detach().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / qmax
    return torch.clamp(torch.round(weight / scale), -qmax - 1, qmax) * scale


class FakeQuantize(torch.nn.Module):
    def __init__(self, bits: str):
        super().__init__()
        if bits not in QMAX:
            raise ValueError(f"QAT format must be one of {', '.join(QMAX)}; got {bits!r}")
        self.bits = bits

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        # straight-through: the forward sees the rounded weight, the gradient flows to weight as is
        return weight + (fake_quantize(weight, self.bits) - weight).detach()


def apply_qat(model: torch.nn.Module, bits: str) -> int:
    """Fake-quantize the weights of every linear layer in the decoder blocks; returns how many."""
    from rooflm.layers.linear import Linear

    count = 0
    for block in model.blocks:
        for module in block.modules():
            if isinstance(module, Linear) and module.quant is None:
                parametrize.register_parametrization(module, "weight", FakeQuantize(bits))
                count += 1
    return count


PARAMETRIZED_SUFFIX = ".parametrizations.weight.original"


def plain_name(name: str) -> str:
    """'...qkv_proj.parametrizations.weight.original' -> '...qkv_proj.weight' (the master weight)."""
    if name.endswith(PARAMETRIZED_SUFFIX):
        return name[: -len(PARAMETRIZED_SUFFIX)] + ".weight"
    return name
