"""SiLU-and-mul for the gated MLP (SwiGLU), in Triton.

Algorithm
---------
The gate and up projections come out of one fused matmul as x [T, 2I]: gate
in the first I columns, up in the last I. The MLP needs

    out = silu(gate) * up,   silu(g) = g * sigmoid(g) = g / (1 + exp(-g))

computed in fp32 with HF's casts (silu rounded to the input dtype, then the
product rounded again), so the two halves are read once and the result
written once instead of materialising silu(gate). Each program owns BLOCK
columns of one row.

Shapes
------
x [T, 2I] (rows may be strided, unit last stride) -> out [T, I]

Work
----
FLOPs: ~5 per output element, negligible.
Bytes: 2 T*I*e read + T*I*e written. Memory-bound: the yardstick is GB/s
against the device's copy bandwidth.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rooflm.kernels.utils import check_last_dim_contiguous, gdc_launch_dependents, gdc_wait, pdl_launch


# --------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------

@triton.jit
def _silu_mul_kernel(out_ptr, x_ptr, stride_x, stride_o, I, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # launched while the kernel before drains (utils.pdl_supported): wait for its x
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------
# Wrapper
# --------------------------------------------------------------------------

BLOCK = 1024


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for x [T, 2I]; returns [T, I] in x's dtype."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [T, 2I], got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"x must be fp16, bf16 or fp32, got {x.dtype}")
    check_last_dim_contiguous("x", x)
    num_rows, two_i = x.shape
    inter = two_i // 2
    out = torch.empty(num_rows, inter, dtype=x.dtype, device=x.device)
    if num_rows > 0 and inter > 0:
        block = min(BLOCK, triton.next_power_of_2(inter))
        _silu_mul_kernel[(num_rows, triton.cdiv(inter, block))](
            out, x, x.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4 if block >= 512 else 2,
            **pdl_launch(x.device),
        )
    return out


# --------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------

def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """HF's act_fn(gate) * up, in x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul_bytes(num_rows: int, inter: int, elem_bytes: int) -> int:
    """Bytes silu_mul must move: gate and up read once, out written once."""
    return 3 * num_rows * inter * elem_bytes
