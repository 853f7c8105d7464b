"""Static FP8 K/V scales from a calibration text: `rooflm quantize --scheme fp8 --kv-cache-scales`.

An FP8 KV cache with static scales (layers/kv_cache.py) stores x / s in E4M3 with one s per layer
for K and one for V, as compressed-tensors' `kv_cache_scheme` (llm-compressor's FP8 K/V recipe)
writes them: `model.layers.N.self_attn.k_scale` / `v_scale`, one fp32 each. Calibration runs the
windows through the model (prefill only) and takes, per layer, the largest |K| after RoPE (what the
cache stores) and the largest |V| over every token and KV head:

    s = max |x| / 448

so the calibration text's values use E4M3's whole range and none saturates; larger values at
serving time saturate at +-448 s. The attention kernels fold s_K into the softmax scale and s_V
into the output, so a static cache costs no per-key scale work (kernels/decode_attention.py).
"""

from __future__ import annotations

import torch

from rooflm.kernels.paged_attention_ref import FP8_MAX
from rooflm.kernels.paged_attention_ref import SCALE_FLOOR

# config.json's quantization_config.kv_cache_scheme, as llm-compressor writes it.
KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def calibrate_kv_scales(llm, windows: list[list[int]]) -> torch.Tensor:
    """[layers, 2 (K, V)] fp32 static scales: each layer's largest |rotated K| and |V| over the
    prefill of `windows`, divided by 448."""
    from rooflm.sampling_params import SamplingParams

    layers = llm.engine.model.model.layers
    amax = torch.zeros(len(layers), 2)
    handles = []
    for i, layer in enumerate(layers):
        attn = layer.self_attn.attn

        def hook(module, args, i=i):
            positions, q, k, v = args[:4]
            _, k_rot = module.rotary(positions, q.float(), k.float())
            amax[i, 0] = torch.maximum(amax[i, 0], k_rot.abs().amax().cpu())
            amax[i, 1] = torch.maximum(amax[i, 1], v.float().abs().amax().cpu())
        handles.append(attn.register_forward_pre_hook(hook))
    try:
        llm.generate(windows, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    finally:
        for h in handles:
            h.remove()
    return (amax / FP8_MAX).clamp_min(SCALE_FLOOR)


def kv_scale_tensors(scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """HF-named checkpoint tensors for [layers, 2] scales (0-dim fp32, llm-compressor's shape)."""
    out = {}
    for layer, (k, v) in enumerate(scales.tolist()):
        out[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k, dtype=torch.float32)
        out[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v, dtype=torch.float32)
    return out
