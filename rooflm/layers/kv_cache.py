"""The paged KV cache's storage formats: the model's dtype, or FP8 (E4M3) with a scale per
token and KV head.

FP8 halves the bytes every decode step reads (K/V is a quarter to a half of a decode step's
traffic on ShareGPT-like traffic with an 8B model) and doubles the tokens the pool holds.
Each stored head vector x (D values of one token and one KV head) is kept as

    scale = max(|x|) / 448          (448: the largest finite E4M3 value; fp32)
    q     = round_to_e4m3(x / scale)

so its largest element uses the whole E4M3 range whatever the layer's magnitudes: no
calibration pass and no static per-tensor scale to get wrong (vLLM's default without a
calibrated checkpoint is a scale of 1.0, which clips keys larger than 448 and wastes the
range of small ones). The scale costs 4 bytes per D bytes (3% at D = 128). The writer (the
fused RoPE + KV-write kernel) computes the scale from the rotated key it already holds in
registers; the attention kernels multiply each key's scores by its K scale and each value's
softmax weight by its V scale, so dequantized K/V never exist in memory.

Layout: scales are their own pool, [num_blocks, block_size, H_kv] per layer and K/V, beside
the data pool [num_blocks, block_size, H_kv, D], so a block's scales move with its data in
swaps and copy-on-write, and the data pool keeps the layout TMA reads.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# A head vector of zeros still gets a finite, positive scale (x / scale stays 0, never NaN).
SCALE_FLOOR = 1e-12
SCALE_BYTES = 4

# What --kv-cache-dtype accepts: "auto" stores the model's dtype.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


class KVCache(NamedTuple):
    """One layer's cache: K and V pools, and their scales when the pool is FP8."""

    k: torch.Tensor  # [num_blocks, block_size, H_kv, D]
    v: torch.Tensor
    k_scale: Optional[torch.Tensor] = None  # [num_blocks, block_size, H_kv] fp32, FP8 only
    v_scale: Optional[torch.Tensor] = None


def parse_kv_cache_dtype(name: str) -> str:
    """'auto' or 'fp8' (fp8_e4m3 is the same format); anything else is an error naming the choices."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return "fp8" if name.startswith("fp8") else "auto"


def is_fp8(kv_cache_dtype: str) -> bool:
    return parse_kv_cache_dtype(kv_cache_dtype) == "fp8"


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return FP8_DTYPE if is_fp8(kv_cache_dtype) else model_dtype


def bytes_per_element(kv_cache_dtype: str, model_dtype: torch.dtype, head_dim: int) -> float:
    """Bytes the pool spends per stored K or V element, the scale's share included."""
    if is_fp8(kv_cache_dtype):
        return 1.0 + SCALE_BYTES / head_dim
    return float(torch.empty((), dtype=model_dtype).element_size())


def quantize_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (E4M3 values [..., D], fp32 scale [...]) with one scale per last-dim row."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / FP8_MAX).clamp_min(SCALE_FLOOR)
    return (xf / scale[..., None]).to(FP8_DTYPE), scale


def dequantize_ref(values: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """fp32 values of stored K or V: the FP8 values times their scales, or the values as they are."""
    if scale is None:
        return values.float()
    return values.float() * scale[..., None]
