"""RMSNorm (with its residual add) and SiLU-mul that write FP8 (E4M3) codes and per-token scales, in Triton.

Why
---
An FP8 W8A8 linear (quant/fp8.py, torch._scaled_mm) multiplies E4M3 activations. Run apart, the
op before it writes its bf16 output and the per-token quantizer (fp8_quant.py) reads it twice
and writes the codes: three kernels' worth of traffic and a launch per linear. Here the norm
before qkv and gate_up, and the SiLU-mul before down, quantize their own output before it leaves
registers: the bf16 activation is never written (1 byte a value instead of 2 written, 4 read
and 1 written). On Llama-3-8B at 1000 x 1024/1024 the quantizer alone took 2.6 ms of a 45.8 ms
mixed step (benchmarks/results/kv-fp8-mma-h100-20261127/).

Algorithm
---------
The value quantized is what the Triton kernels it replaces write, with their arithmetic, so the
result is bit for bit per_token_fp8(rmsnorm(x)) (or per_token_fp8(silu_mul(x))) of
kernels/rmsnorm.py and kernels/silu_mul.py:

    rmsnorm_fp8:  r' = x + r (rounded to x's dtype; stored)     only with a residual
                  y  = w * (r'_fp32 * rsqrt(mean(r'^2) + eps)).to(dtype)     HF's casts
    silu_mul_fp8: y  = (silu(gate).to(dtype) * up).to(dtype)                the silu_mul kernel's
    then          s  = max(max|y| / 448, MIN_SCALE) per row      (dynamic; static: the given scale)
                  q  = e4m3(clamp(y / s, -448, 448))              IEEE divides (div_rn), as torch's

RMSNorm holds its row in registers (one program a row, as kernels/rmsnorm.py). So does SiLU-mul up
to SILU_ROW_MAX columns (14336 on Llama-3-8B: 16 warps, 32 values a thread). Longer rows take two
passes: pass one computes y chunk by chunk for max|y|, pass two computes it again (gate/up re-read,
from L2 if they are still there) and stores the codes; a static scale needs one pass.

Shapes
------
rmsnorm_fp8:  x, residual [T, N] -> q [T, N] e4m3, s [T, 1] fp32 (, x + residual [T, N])
silu_mul_fp8: x [T, 2I] (gate, then up) -> q [T, I] e4m3, s [T, 1] fp32

Work
----
FLOPs ~6 a value, negligible. Bytes per row (e = 2 for bf16): rmsnorm_fp8 N e read (+ N e residual
read and N e written) + N written + 4; silu_mul_fp8 2 I e read + I + 4 (rows past SILU_ROW_MAX: the
2 I e read twice).
Memory-bound: the yardstick is GB/s against the copy bandwidth.

The references below are the definition: the unfused torch references, composed. Triton's 1/sqrt
and exp round differently from torch's rsqrt and exp, so a code may sit one e4m3 step from the
reference's (as the Triton norm's output may sit one bf16 step from torch's). Triton's CPU
interpreter rounds fp32 -> e4m3 wrongly (fp8_quant.py's header): off CUDA sm89+ the wrappers run
the references.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from rooflm.kernels.fp8_quant import FP8_DTYPE, FP8_MAX, MIN_SCALE, per_token_fp8_ref, static_fp8
from rooflm.kernels.rmsnorm import rmsnorm_row
from rooflm.kernels.utils import check_last_dim_contiguous, gdc_launch_dependents, gdc_wait, next_power_of_2, pdl_launch


# --------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------

@triton.jit
def _row_scale(y, s_ptr, row, STATIC: tl.constexpr, FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr):
    """The row's scale: loaded (static), or max|y| / 448 floored, stored (dynamic)."""
    if STATIC:
        return tl.load(s_ptr)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(y), axis=0), FP8_MAX_C), MIN_SCALE_C)
    tl.store(s_ptr + row, scale)
    return scale


@triton.jit
def _rmsnorm_fp8_kernel(q_ptr, s_ptr, x_ptr, residual_ptr, residual_out_ptr, weight_ptr,
                        stride_x, stride_r, stride_q, stride_ro, N, eps,
                        BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, STATIC: tl.constexpr,
                        FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # launched while the kernel before drains (utils.pdl_supported): wait for its x
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    y = rmsnorm_row(x_ptr, residual_ptr, residual_out_ptr, weight_ptr, row, stride_x, stride_r, stride_ro,
                    offs, mask, N, eps, HAS_RESIDUAL)
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32)  # the value rmsnorm.py writes
    scale = _row_scale(y, s_ptr, row, STATIC, FP8_MAX_C, MIN_SCALE_C)
    q = tl.clamp(tl.math.div_rn(y, scale), -FP8_MAX_C, FP8_MAX_C)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_chunk(x_row, k0, cols, I, dtype: tl.constexpr):
    """silu(gate) * up over columns [k0, k0 + BLOCK), with silu_mul's casts, in fp32."""
    mask = (k0 + cols) < I
    gate = tl.load(x_row + k0 + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + I + k0 + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (silu * up).to(dtype).to(tl.float32), mask


@triton.jit
def _silu_mul_fp8_kernel(q_ptr, s_ptr, x_ptr, stride_x, stride_q, I,
                         BLOCK: tl.constexpr, STATIC: tl.constexpr, ONE_PASS: tl.constexpr,
                         FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    dtype = x_ptr.dtype.element_ty
    x_row = x_ptr + row * stride_x
    if ONE_PASS:  # BLOCK >= I: the whole row in registers, gate/up read once
        y, mask = _silu_mul_chunk(x_row, 0, cols, I, dtype)
        scale = _row_scale(y, s_ptr, row, STATIC, FP8_MAX_C, MIN_SCALE_C)
        q = tl.clamp(tl.math.div_rn(y, scale), -FP8_MAX_C, FP8_MAX_C)
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        return
    if STATIC:
        scale = tl.load(s_ptr)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, I, BLOCK):
            y, _ = _silu_mul_chunk(x_row, k0, cols, I, dtype)
            amax = tl.maximum(amax, tl.abs(y))
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FP8_MAX_C), MIN_SCALE_C)
        tl.store(s_ptr + row, scale)
    for k0 in range(0, I, BLOCK):
        y, mask = _silu_mul_chunk(x_row, k0, cols, I, dtype)
        q = tl.clamp(tl.math.div_rn(y, scale), -FP8_MAX_C, FP8_MAX_C)
        tl.store(q_ptr + row * stride_q + k0 + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------
# Wrappers
# --------------------------------------------------------------------------

MAX_HIDDEN = 65536  # rmsnorm_fp8 holds a row in registers
SILU_BLOCK = 4096  # columns a silu_mul_fp8 program takes per loop step (rows longer than SILU_ROW_MAX)
# Rows up to this many columns are held whole in registers (one pass; 16 warps, 32 fp32 values a
# thread at 16384). The two-pass loop re-read gate/up: at 2048 x 14336 its second pass missed L2
# (2048 rows x 57 KB) and the kernel moved ~1.5 TB/s.
SILU_ROW_MAX = 16384


def triton_fp8_usable(x: torch.Tensor) -> bool:
    """Triton converts to e4m3 (fp8e4nv) on CUDA sm89+ only."""
    return x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) >= (8, 9)


def _check_activation(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} takes a 2-D [tokens, features] tensor; got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"{name} takes fp16, bf16 or fp32 activations; got {x.dtype}")
    check_last_dim_contiguous(name, x)


def _static_scale(scale: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if scale is not None and scale.numel() != 1:
        raise ValueError(f"a static activation scale is one value; got shape {tuple(scale.shape)}")
    return scale


def rmsnorm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None,
                static_scale: Optional[torch.Tensor] = None):
    """(q [T, N] e4m3, s [T, 1] fp32) of rmsnorm(x) (or of rmsnorm(x + residual), then also x +
    residual: (q, s, x + residual)). static_scale: a checkpoint's per-tensor input scale, used for
    every row (s is it, expanded), else per-token scales. Inputs are not modified."""
    _check_activation("rmsnorm_fp8", x)
    rows, n = x.shape
    if weight.shape != (n,):
        raise ValueError(f"weight must be [{n}], got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {residual.dtype} {tuple(residual.shape)} must match x {x.dtype} {tuple(x.shape)}")
    if n > MAX_HIDDEN:
        raise ValueError(f"hidden size up to {MAX_HIDDEN} is supported, got {n}")
    static_scale = _static_scale(static_scale)
    if not triton_fp8_usable(x):
        return rmsnorm_fp8_ref(x, weight, eps, residual, static_scale)
    check_last_dim_contiguous("weight", weight)
    q = torch.empty((rows, n), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else None
    if residual is not None:
        check_last_dim_contiguous("residual", residual)
    if rows:
        block = next_power_of_2(n)
        _rmsnorm_fp8_kernel[(rows,)](
            q, static_scale.reshape(1).float() if static_scale is not None else s, x,
            residual if residual is not None else x, res_out if res_out is not None else x, weight,
            x.stride(0), (residual if residual is not None else x).stride(0), q.stride(0),
            (res_out if res_out is not None else x).stride(0), n, eps,
            BLOCK=block, HAS_RESIDUAL=residual is not None, STATIC=static_scale is not None,
            FP8_MAX_C=FP8_MAX, MIN_SCALE_C=MIN_SCALE,
            num_warps=16 if block >= 16384 else 8 if block >= 4096 else 4 if block >= 1024 else 2,
            **pdl_launch(x.device))
    if static_scale is not None:
        s = static_scale.reshape(1, 1).float().expand(rows, 1)
    return (q, s) if residual is None else (q, s, res_out)


def silu_mul_fp8(x: torch.Tensor, static_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [T, I] e4m3, s [T, 1] fp32) of silu(x[:, :I]) * x[:, I:] for x [T, 2I]; static_scale as
    rmsnorm_fp8's."""
    _check_activation("silu_mul_fp8", x)
    if x.shape[1] % 2:
        raise ValueError(f"silu_mul_fp8 takes [T, 2I]; got {tuple(x.shape)}")
    static_scale = _static_scale(static_scale)
    if not triton_fp8_usable(x):
        return silu_mul_fp8_ref(x, static_scale)
    rows, inter = x.shape[0], x.shape[1] // 2
    q = torch.empty((rows, inter), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows and inter:
        one_pass = next_power_of_2(inter) <= SILU_ROW_MAX
        block = next_power_of_2(inter) if one_pass else SILU_BLOCK
        _silu_mul_fp8_kernel[(rows,)](
            q, static_scale.reshape(1).float() if static_scale is not None else s, x,
            x.stride(0), q.stride(0), inter, BLOCK=block, STATIC=static_scale is not None, ONE_PASS=one_pass,
            FP8_MAX_C=FP8_MAX, MIN_SCALE_C=MIN_SCALE,
            num_warps=16 if block >= 8192 else 8 if block >= 2048 else 4, **pdl_launch(x.device))
    if static_scale is not None:
        s = static_scale.reshape(1, 1).float().expand(rows, 1)
    return q, s


# --------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------

def _quantize_ref(y: torch.Tensor, static_scale: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    if static_scale is None:
        return per_token_fp8_ref(y)
    scale = static_scale.reshape(1, 1).float()
    return static_fp8(y, scale), scale.expand(y.shape[0], 1)


def rmsnorm_fp8_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None,
                    static_scale: Optional[torch.Tensor] = None):
    """The unfused ops: kernels/rmsnorm.py's reference, then the FP8 quantizer's."""
    from rooflm.kernels.rmsnorm import rmsnorm_ref
    if residual is None:
        return _quantize_ref(rmsnorm_ref(x, weight, eps), static_scale)
    y, res = rmsnorm_ref(x, weight, eps, residual)
    return (*_quantize_ref(y, static_scale), res)


def silu_mul_fp8_ref(x: torch.Tensor, static_scale: Optional[torch.Tensor] = None):
    """The unfused ops: silu_mul (HF's casts), then the FP8 quantizer."""
    from rooflm.kernels.silu_mul import silu_mul_ref
    return _quantize_ref(silu_mul_ref(x), static_scale)

