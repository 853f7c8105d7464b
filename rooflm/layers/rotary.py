"""Rotary position embedding (RoPE): plain, Llama-3.1, linear, LongRoPE and YaRN scaling; over the
whole head or its first rotary_dim features (partial rotary); or none (a layer without RoPE).

The cos/sin table is built once, in fp32, for every position up to the
model's context: cos_sin_cache[pos] = [cos(pos * f_0..f_{R/2-1}), sin(...)], R the rotated
width. HF Llama-family checkpoints use the "neox" layout (rotate the two halves of
the rotated part); GGUF files are converted back to it by the loader.

The fused CUDA kernel (kernels/rope_kv_write.py, through layers/cuda_attention.py) reads the
table when it is fp32 and as wide as the head: a partial rotary's table is narrower and a
layer without RoPE has none, so both take the torch rotation there, then the plain KV write.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from rooflm.config import RopeScaling


@dataclass(frozen=True)
class Rope:
    """One layer's rotary: its base, scaling and rotated width (None: the whole head).
    Layers with equal Ropes share one table (model/spec.py's layer_ropes)."""

    theta: float
    scaling: Optional[RopeScaling] = None
    rotary_dim: Optional[int] = None


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[RopeScaling]) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "longrope":
        return longrope_inv_freq(head_dim, theta, scaling.short_factor)
    if scaling.rope_type == "yarn":
        return yarn_inv_freq(head_dim, theta, scaling)
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


def longrope_inv_freq(dim: int, theta: float, factors: Sequence[float]) -> torch.Tensor:
    """LongRoPE's frequencies: each plain frequency divided by its own factor."""
    if len(factors) != dim // 2:
        raise ValueError(f"longrope needs {dim // 2} factors for a rotated width of {dim}, got {len(factors)}")
    ext = torch.tensor(factors, dtype=torch.float32)
    return 1.0 / (ext * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def yarn_inv_freq(dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN's frequencies as HF computes them (_compute_yarn_parameters): the plain frequency where
    a dimension turns more than beta_fast times over the original context, the interpolated one
    (divided by factor) where it turns fewer than beta_slow times, a linear ramp between."""
    def correction_dim(rotations: float) -> float:
        original = scaling.original_max_position_embeddings
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # the share of the plain frequency
    plain = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return plain / scaling.factor * (1 - extrapolation) + plain * extrapolation


def yarn_attention_factor(scaling: RopeScaling) -> float:
    """The factor on cos and sin: given, or 0.1 ln(factor) + 1 (the mscale / mscale_all_dim ratio
    of that form where both are given), HF's."""
    if scaling.attention_factor is not None:
        return scaling.attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.factor, scaling.mscale) / mscale(scaling.factor, scaling.mscale_all_dim)
    return mscale(scaling.factor)


def longrope_attention_factor(scaling: RopeScaling) -> float:
    """The factor on cos and sin (so on q.k twice): given, or LongRoPE's default from the context
    extension (HF's: 1 when not extended)."""
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(scaling.factor) / math.log(scaling.original_max_position_embeddings))


def build_cos_sin_cache(head_dim: int, max_positions: int, theta: float,
                        scaling: Optional[RopeScaling]) -> torch.Tensor:
    """[max_positions, head_dim] fp32 (head_dim: the rotated width)."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    if scaling is not None and scaling.rope_type == "longrope":
        # HF picks short or long factors for a whole forward by its longest position; a paged cache
        # keeps every key as first rotated, so here the choice is per position: short below the
        # original context, long from it on. Within the original context both are HF's.
        short = longrope_inv_freq(head_dim, theta, scaling.short_factor)
        long = longrope_inv_freq(head_dim, theta, scaling.long_factor)
        inv_freq = torch.where(positions[:, None] < scaling.original_max_position_embeddings, short, long)
        freqs = positions[:, None] * inv_freq
        mscale = longrope_attention_factor(scaling)
        return torch.cat([freqs.cos() * mscale, freqs.sin() * mscale], dim=-1)
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    freqs = torch.outer(positions, inv_freq)
    if scaling is not None and scaling.rope_type == "yarn":
        mscale = yarn_attention_factor(scaling)
        return torch.cat([freqs.cos() * mscale, freqs.sin() * mscale], dim=-1)
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
    """RoPE over the first rotary_dim features of each head (all of them by default); the rest
    pass unrotated (HF's partial rotary, Phi-3's and Phi-4-mini's)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: Optional[RopeScaling], rotary_dim: Optional[int] = None):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim must be even and in (0, {head_dim}], got {self.rotary_dim}")
        cache = build_cos_sin_cache(self.rotary_dim, max_positions, theta, scaling)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, H, D], k: [T, H_kv, D] -> rotated (q, k)."""
        cos_sin = self.cos_sin_cache.index_select(0, positions)
        cos, sin = cos_sin.chunk(2, dim=-1)
        cos = cos.to(q.dtype)
        sin = sin.to(q.dtype)
        r = self.rotary_dim
        if r == self.head_dim:
            return apply_rope_torch(q, cos, sin), apply_rope_torch(k, cos, sin)
        return (torch.cat([apply_rope_torch(q[..., :r], cos, sin), q[..., r:]], dim=-1),
                torch.cat([apply_rope_torch(k[..., :r], cos, sin), k[..., r:]], dim=-1))


class NoRotary(torch.nn.Module):
    """A layer without RoPE (SmolLM3's every fourth): q and k as they are. It has no
    cos_sin_cache, so the fused rope+write kernels pass it by (plain KV write)."""

    is_neox = True

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return q, k


def shared_rotaries(ropes: Sequence[Optional[Rope]], head_dim: int, max_positions: int) -> list[torch.nn.Module]:
    """One rotary module per layer, built once per distinct Rope (None: NoRotary)."""
    built: dict[Any, torch.nn.Module] = {}
    for rope in ropes:
        if rope not in built:
            built[rope] = NoRotary() if rope is None else RotaryEmbedding(
                head_dim, max_positions, rope.theta, rope.scaling, rope.rotary_dim)
    return [built[rope] for rope in ropes]


def rope_scaling_from_hf(scaling: dict[str, Any], max_position_embeddings: int,
                         original_max_position_embeddings: Optional[int] = None) -> Optional[RopeScaling]:
    """An HF rope_scaling / rope_parameters dict -> RopeScaling (None for plain RoPE).
    original_max_position_embeddings: a config's top-level value, which HF prefers (Phi-3).
    Raises ValueError naming what is missing or unsupported."""
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type == "su":  # Phi-3's early name for LongRoPE (HF renames it too)
        rope_type = "longrope"
    try:
        if rope_type == "llama3":
            return RopeScaling("llama3", factor=float(scaling["factor"]),
                               low_freq_factor=float(scaling["low_freq_factor"]),
                               high_freq_factor=float(scaling["high_freq_factor"]),
                               original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
        if rope_type == "linear":
            return RopeScaling("linear", factor=float(scaling["factor"]))
        if rope_type == "yarn":
            original = int(scaling["original_max_position_embeddings"])
            factor = scaling.get("factor")
            optional = {key: float(scaling[key]) for key in ("attention_factor", "mscale", "mscale_all_dim")
                        if scaling.get(key) is not None}
            # HF's `or`: a beta of 0 or None takes the default
            return RopeScaling("yarn", factor=float(factor) if factor is not None else max_position_embeddings / original,
                               original_max_position_embeddings=original,
                               beta_fast=float(scaling.get("beta_fast") or 32), beta_slow=float(scaling.get("beta_slow") or 1),
                               truncate=bool(scaling.get("truncate", True)), **optional)
        if rope_type == "longrope":
            original = int(original_max_position_embeddings or scaling.get("original_max_position_embeddings")
                           or max_position_embeddings)
            factor = scaling.get("factor")
            # Phi-3 writes no factor: the extension is the context over the original one.
            factor = float(factor) if factor is not None else max_position_embeddings / original
            attention_factor = scaling.get("attention_factor")
            return RopeScaling("longrope", factor=factor, original_max_position_embeddings=original,
                               short_factor=tuple(scaling["short_factor"]), long_factor=tuple(scaling["long_factor"]),
                               attention_factor=None if attention_factor is None else float(attention_factor))
    except KeyError as exc:
        raise ValueError(f"{rope_type} rope scaling is missing {exc.args[0]!r}") from exc
    return RopeScaling(rope_type)  # an unsupported type: RopeScaling names it
