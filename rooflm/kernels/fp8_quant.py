"""Dynamic per-token FP8 (E4M3) quantization of activations, in Triton.

Why
---
An FP8 W8A8 matmul (torch._scaled_mm on sm89+) multiplies fp8 activations by fp8 weights on the
fp8 tensor cores, twice bf16's rate. The activations arrive in bf16 each step, so they are
quantized on the fly: one scale per token (row), s = max|x_row| / 448 (448: E4M3's largest
finite value), q = x / s rounded to E4M3. Per-token scales follow each token's own range
(vLLM's `dynamic_per_token_scaled_fp8_quant`, compressed-tensors' "token" strategy), so an
outlier token does not crush the others' precision as a per-tensor scale would.

Algorithm
---------
One program per row: pass 1 reads the row to find max|x|, pass 2 reads it again, divides by the
scale, saturates to +-448 and stores fp8. Rows of the model's activations (hidden 4096-14336 in
bf16) fit in one tile; a longer row is walked in BLOCK tiles.

Work
----
FLOPs ~3 M K (abs/max, divide, clamp). Bytes 2 M K read twice (the second from L2 for these
row sizes) + M K written + 4 M scales: memory-bound, ~1.5x the bytes of one bf16 copy of x.

The torch reference below is the definition; the kernel must match it bit for bit (the same
fp32 divide, the same round-to-nearest-even saturating cast). Triton 3.9's CPU interpreter
rounds fp32 -> e4m3 wrongly where rounding carries into the exponent (-31.7 came out -16, not
-32), so off CUDA the wrapper runs the reference and the kernel is tested on the GPU only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# A row of zeros would give scale 0 and 0/0: the scale is floored (vLLM uses 1 / (448 * 512)).
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


# --------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------

@triton.jit
def _per_token_fp8_kernel(q_ptr, s_ptr, x_ptr, K, stride_xm, stride_qm,
                          FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        mask = (k0 + cols) < K
        x = tl.load(x_ptr + row * stride_xm + k0 + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    # div_rn: Triton's fp32 `/` is div.full.f32 (up to 2 ulp off) on NVIDIA; the reference's
    # torch divide is IEEE round-to-nearest, and one ulp can flip a code's rounding.
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FP8_MAX_C), MIN_SCALE_C)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        mask = (k0 + cols) < K
        x = tl.load(x_ptr + row * stride_xm + k0 + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX_C, FP8_MAX_C)
        tl.store(q_ptr + row * stride_qm + k0 + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------
# Wrapper
# --------------------------------------------------------------------------

def per_token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (fp32/bf16/fp16) -> (q [M, K] float8_e4m3fn, scale [M, 1] fp32), x ~= q * scale.
    Triton on CUDA sm89+, the torch reference elsewhere (see the header on the interpreter)."""
    if x.dim() != 2:
        raise ValueError(f"per_token_fp8 takes a 2-D [tokens, features] tensor; got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"per_token_fp8 takes fp32/bf16/fp16 activations; got {x.dtype}")
    if x.device.type != "cuda" or torch.cuda.get_device_capability(x.device) < (8, 9):
        # Triton converts to e4m3 (fp8e4nv) only on sm89+; an A100 takes the torch casts.
        return per_token_fp8_ref(x)
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    block = min(triton.next_power_of_2(k), 8192)
    _per_token_fp8_kernel[(m,)](q, scale, x, k, x.stride(0), q.stride(0),
                                FP8_MAX_C=FP8_MAX, MIN_SCALE_C=MIN_SCALE, BLOCK=block,
                                num_warps=4 if block <= 2048 else 8)
    return q, scale


# --------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------

def per_token_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition: fp32 scale = max(max|x_row| / 448, MIN_SCALE); q = cast(clamp(x / scale))."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    # A tensor divisor, not the Python float: CUDA torch turns `t / scalar` into t * (1 / scalar),
    # which is one ulp off an IEEE divide for some amax (the H100 run of 2026-11-25 caught it);
    # the kernel's div_rn and this divide are both round-to-nearest.
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp_min(MIN_SCALE)
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def static_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Activations quantized with a checkpoint's static (calibrated) per-tensor scale."""
    return (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
