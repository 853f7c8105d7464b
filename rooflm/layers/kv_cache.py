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

Static scales (--kv-cache-scales static, or a checkpoint that carries them): one fixed fp32
scale per layer and KV head, [H_kv], for K and for V, as vLLM and TensorRT-LLM keep FP8 K/V.
Stored values are round_to_e4m3(clamp(x / scale, -448, 448)). The attention kernels fold the K
scale into the query's softmax scale and the V scale into the output, so their inner loop has
no per-key scale load or multiply (on the H100 the per-token scales cost ~20% of the FP8
decode kernel's time: benchmarks/results/kv-fp8-tiles-h100-20261126/). The scales come from
the checkpoint (compressed-tensors' kv_cache_scheme: self_attn.k_scale / v_scale, calibrated
by llm-compressor) or are 1.0, vLLM's default, which clips |x| > 448 and rounds values under
2^-6 coarsely: per-token scales stay the default for checkpoints without them.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from rooflm.kernels.paged_attention_ref import FP8_DTYPE

SCALE_BYTES = 4

# What --kv-cache-dtype accepts: "auto" stores the model's dtype.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# What --kv-cache-scales accepts (FP8 caches): auto is the checkpoint's static scales where it
# has them, else per-token; static is the checkpoint's, else 1.0.
KV_CACHE_SCALES = ("auto", "per-token", "static")


class KVCache(NamedTuple):
    """One layer's cache: K and V pools, and their scales when the pool is FP8."""

    k: torch.Tensor  # [num_blocks, block_size, H_kv, D]
    v: torch.Tensor
    # FP8 only: [num_blocks, block_size, H_kv] fp32 per token, or [H_kv] fp32 static.
    k_scale: Optional[torch.Tensor] = None
    v_scale: Optional[torch.Tensor] = None
    # The layer's KV cache group (engine/kv_groups.py): which of the step's block tables and
    # slot mappings address its pool (AttentionMetadata.for_group). 0 with one group.
    group: int = 0


def num_kv_groups(kv_caches) -> int:
    """KV cache groups among the layers' caches (KVCache.group): 1 with one table for all."""
    return 1 + max((getattr(c, "group", 0) for c in kv_caches), default=0)


def resolve_kv_scales(kv_cache_scales: str, checkpoint_has_scales: bool) -> str:
    """'per-token' or 'static' for an FP8 cache, from --kv-cache-scales and the checkpoint."""
    if kv_cache_scales not in KV_CACHE_SCALES:
        raise ValueError(f"kv_cache_scales must be one of {', '.join(KV_CACHE_SCALES)}, got {kv_cache_scales!r}")
    if kv_cache_scales == "auto":
        return "static" if checkpoint_has_scales else "per-token"
    return kv_cache_scales


def parse_kv_cache_dtype(name: str) -> str:
    """'auto' or 'fp8' (fp8_e4m3 is the same format); anything else is an error naming the choices."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return "fp8" if name.startswith("fp8") else "auto"


def is_fp8(kv_cache_dtype: str) -> bool:
    return parse_kv_cache_dtype(kv_cache_dtype) == "fp8"


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return FP8_DTYPE if is_fp8(kv_cache_dtype) else model_dtype


def bytes_per_element(kv_cache_dtype: str, model_dtype: torch.dtype, head_dim: int,
                      token_scales: bool = True) -> float:
    """Bytes the pool spends per stored K or V element, a per-token scale's share included."""
    if is_fp8(kv_cache_dtype):
        return 1.0 + (SCALE_BYTES / head_dim if token_scales else 0.0)
    return float(torch.empty((), dtype=model_dtype).element_size())
