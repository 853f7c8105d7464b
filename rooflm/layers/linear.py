"""Linear layers whose weights are fused from several checkpoint tensors.

Fusing q/k/v into one matmul and gate/up into another halves the kernel
launches of a layer. The checkpoint stores them apart, so each fused layer
knows which row range a named shard goes to.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


class Linear(torch.nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features))
        self.bias = torch.nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class FusedLinear(Linear):
    """Rows [offset, offset + size) of the output belong to the shard named `name`."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size

    def load_shard(self, shard: str, param_kind: str, tensor: torch.Tensor) -> None:
        offset, size = self.shard_offsets[shard]
        target: Optional[torch.nn.Parameter] = self.weight if param_kind == "weight" else self.bias
        if target is None:
            raise ValueError(f"checkpoint has a {shard} bias but the model config has none")
        expected = (size,) + tuple(target.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"shape mismatch for {shard}.{param_kind}: checkpoint {tuple(tensor.shape)}, "
                f"model expects {expected}")
        with torch.no_grad():
            target[offset:offset + size].copy_(tensor)
