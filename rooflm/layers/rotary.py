"""Rotary position embedding (RoPE), with Llama-3.1 frequency scaling.

The cos/sin table is built once, in fp32, for every position up to the
model's context: cos_sin_cache[pos] = [cos(pos * f_0..f_{D/2-1}), sin(...)].
HF Llama-family checkpoints use the "neox" layout (rotate the two halves of
the head); GGUF files are converted back to it by the loader.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from rooflm.config import RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[RopeScaling]) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the
    # band between is interpolated smoothly (Meta's reference implementation).
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def build_cos_sin_cache(head_dim: int, max_positions: int, theta: float,
                        scaling: Optional[RopeScaling]) -> torch.Tensor:
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [max_positions, head_dim]


def apply_rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, D/2] in x's dtype. Neox layout."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos = cos[:, None, :]
    sin = sin[:, None, :]
    # Same arithmetic as HF's q * cos + rotate_half(q) * sin with cos/sin duplicated.
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: Optional[RopeScaling]):
        super().__init__()
        self.head_dim = head_dim
        cache = build_cos_sin_cache(head_dim, max_positions, theta, scaling)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, H, D], k: [T, H_kv, D] -> rotated (q, k)."""
        cos_sin = self.cos_sin_cache.index_select(0, positions)
        cos, sin = cos_sin.chunk(2, dim=-1)
        cos = cos.to(q.dtype)
        sin = sin.to(q.dtype)
        return apply_rope_torch(q, cos, sin), apply_rope_torch(k, cos, sin)
