"""FP8 W8A8: E4M3 weights with one scale per output channel, activations quantized to E4M3 per token.

    y[m, n] = sx[m] * sw[n] * sum_k qx[m, k] qw[n, k]

Both scales factor out of the sum, so the fp8 tensor cores multiply the codes and the epilogue
applies the outer product of the scales: torch._scaled_mm with row-wise scales (sm89+: Ada,
Hopper), at twice bf16's FLOP rate and half its weight bytes. Elsewhere (the CPU, older GPUs)
the same sum runs in fp32 on the codes upcast, which is what the tensor cores compute up to the
order of the fp32 additions: the CPU drift figures are the format's real numerics, not a
simulation of them (the codes and scales are the same fp8 and fp32 values).

On Hopper the product runs with fast accumulation (use_fast_accum): the fp8 wgmma chain adds its
products into the accumulator with fewer mantissa bits than fp32 over the whole K, where
_scaled_mm's default promotes each slice's partial sum into fp32. vLLM's CUTLASS FP8 kernels for
sm90 use the FastAccum schedules, and torchao's Float8Linear takes it for the forward product. On
the H100 at a decode step's M = 323 (Llama-3-8B) it took qkv 28.2 -> 23.4 us, gate_up 104.1 ->
80.0, for a relative error against the exact sum of 2.1e-3 instead of 1.7e-3 (K = 4096; 3.3e-3
at down's K = 14336), bf16's output rounding being ~1.7e-3 of it (benchmarks/fp8_matmul.py,
benchmarks/results/fp8-fused-h100-20261127/). ROOFLM_FP8_FAST_ACCUM=0 promotes.

Weights: sw[n] = max|W[n, :]| / 448, qw = E4M3(W / sw) (round to nearest even, saturating).
Activations: dynamic per-token (kernels/fp8_quant.py), or a checkpoint's static per-tensor
input_scale (vLLM/llm-compressor `activation_scheme: static`), or none (weight-only FP8
checkpoints: the weights are dequantized into the activations' dtype).

Checkpoint layouts read (checkpoint.py detects them from config.json):
  vLLM/HF "fp8"       quant_method "fp8"; `<linear>.weight` float8_e4m3fn [N, K],
                      `.weight_scale` fp32 scalar (per tensor) or [N] / [N, 1] (per channel),
                      `.input_scale` fp32 scalar when activation_scheme is "static".
                      weight_block_size (DeepSeek-style 128x128 blocks) is not supported.
  compressed-tensors  quant_method "compressed-tensors", format "float-quantized" (llm-compressor's
                      FP8 / FP8_DYNAMIC): the same tensor names, weight_scale [N, 1] (channel) or
                      [1] (tensor); input activations "token" + dynamic, "tensor" + static, or none.
`rooflm quantize --scheme fp8` writes compressed-tensors, channel weights, dynamic token activations.

The runtime form is formats.Fp8Weight; the module that multiplies it is linear_method.Fp8Linear.
`--quantization fp8` quantizes a float model's decoder linears at load (the LM head and
embeddings stay in float, as vLLM's fp8 does by default).
"""

from __future__ import annotations

from typing import Optional

import torch

from rooflm.kernels.fp8_quant import FP8_DTYPE, FP8_MAX
from rooflm.quant.formats import Fp8Weight


def quantize_fp8_weight(w: torch.Tensor, activations: str = "dynamic") -> Fp8Weight:
    """Per-output-channel E4M3: sw = max|row| / 448 (fp32), codes = E4M3(w / sw)."""
    wf = w.detach().float()
    scales = (wf.abs().amax(dim=1) / FP8_MAX).clamp_min(1e-12)
    codes = (wf / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Weight(codes, scales, activations)


def from_checkpoint(weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: Optional[torch.Tensor],
                    activations: str) -> Fp8Weight:
    """An fp8 checkpoint's tensors -> Fp8Weight; per-tensor scales broadcast to the rows."""
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"fp8 weight has dtype {weight.dtype}, expected float8_e4m3fn")
    n = weight.shape[0]
    scale = weight_scale.float().reshape(-1)
    if scale.numel() == 1:
        scale = scale.expand(n).clone()
    elif scale.numel() != n:
        raise ValueError(f"weight_scale has {scale.numel()} values for {n} output channels "
                         f"(per-tensor or per-channel expected; block scales are not supported)")
    if activations == "static" and input_scale is None:
        raise ValueError("activation scheme is static but the checkpoint has no input_scale")
    return Fp8Weight(weight, scale, activations,
                     None if input_scale is None else input_scale.float().reshape(-1).max())


def to_compressed_tensors(weight: Fp8Weight) -> dict[str, torch.Tensor]:
    """compressed-tensors float-quantized, channel strategy: weight fp8 [N, K], weight_scale [N, 1]."""
    return {"weight": weight.codes.contiguous(), "weight_scale": weight.scales.float().reshape(-1, 1).contiguous()}


def compressed_tensors_config() -> dict:
    """quantization_config of llm-compressor's FP8_DYNAMIC scheme (what `rooflm quantize --scheme fp8` writes)."""
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                        "dynamic": False, "group_size": None, "observer": "minmax"},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                  "dynamic": True, "observer": None},
            "output_activations": None}},
        "ignore": ["lm_head"], "kv_cache_scheme": None,
    }


def quantize_fp8_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked expert weights [E, N, K] -> (E4M3 codes [E, N, K], fp32 scales [E, N]): every
    expert's rows per output channel, as quantize_fp8_weight does a Linear's. One expert at a
    time, so the fp32 temporaries are one expert's, not the layer's (1.6 GB at Qwen3-30B-A3B's
    w13)."""
    if w.dim() != 3:
        raise ValueError(f"stacked expert weights must be [E, N, K], got {tuple(w.shape)}")
    codes = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    scales = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
    for e in range(w.shape[0]):
        q = quantize_fp8_weight(w[e])
        codes[e] = q.codes
        scales[e] = q.scales
    return codes, scales
