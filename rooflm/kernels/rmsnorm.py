"""RMSNorm, optionally fused with the residual add, in Triton.

Algorithm
---------
For each row x of length N (one token's hidden state):

    residual' = x + residual                       (only with a residual; rounded to x's dtype)
    h         = residual' (or x)
    y         = weight * (h_fp32 * rsqrt(mean(h_fp32^2) + eps)).to(dtype)

or, as a post-norm (post_add, Gemma 2/3 and OLMo 2 at one token), post_add + y, rounded as
torch's add of the two in x's dtype: the norm and the residual add after it in one launch.

This is HF transformers' LlamaRMSNorm, casts included: the normalised value
is rounded to the input dtype before the weight multiplies it. One program
owns one row; the whole row sits in registers, so x and residual are read
once and y (and the new residual) written once. Fusing the add saves a full
read and write of the hidden state per norm compared with add-then-norm.

Shapes
------
x, residual [T, N] (rows may be strided, unit last stride), weight [N].

Work
----
FLOPs: ~4N per row, negligible.
Bytes: without residual T*N*e (read) + T*N*e (write) + N*e_w (weight);
       with residual 2 T*N*e (read) + 2 T*N*e (write) + N*e_w.
Memory-bound: the yardstick is GB/s against the device's copy bandwidth.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl

from rooflm.kernels.utils import check_last_dim_contiguous, gdc_launch_dependents, gdc_wait, next_power_of_2, pdl_launch


# --------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------

@triton.jit
def rmsnorm_row(x_ptr, residual_ptr, residual_out_ptr, weight_ptr, row, stride_x, stride_r, stride_ro,
                offs, mask, N, eps, HAS_RESIDUAL: tl.constexpr):
    """One row's weight * normalised value in fp32 (HF's cast of the normalised value applied; the
    product not yet rounded), storing x + residual first when HAS_RESIDUAL. norm_act_fp8.py shares it."""
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        # Round the sum to the input dtype, as torch's x + residual does.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, 0) / N + eps)
    normed = (h * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    return normed * tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _rmsnorm_kernel(out_ptr, x_ptr, residual_ptr, residual_out_ptr, weight_ptr,
                    stride_x, stride_r, stride_o, stride_ro, N, eps,
                    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr = False,
                    POST_ADD: tl.constexpr = False):
    if PDL:  # launched while the kernel before drains (utils.pdl_supported): wait for its x
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    y = rmsnorm_row(x_ptr, residual_ptr, residual_out_ptr, weight_ptr, row, stride_x, stride_r, stride_ro,
                    offs, mask, N, eps, HAS_RESIDUAL)
    if POST_ADD:  # residual_ptr holds the addend: post_add + norm(x), each rounded as torch's add
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32) + r
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------
# Wrapper
# --------------------------------------------------------------------------

MAX_HIDDEN = 65536  # one row per program, held in registers


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: Optional[torch.Tensor] = None, *, post_add: Optional[torch.Tensor] = None
            ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """RMSNorm of x [T, N]; output in x's dtype.

    Without residual returns weight * x / rms(x). With residual returns
    (rmsnorm(x + residual), x + residual); the inputs are not modified.
    post_add [T, N] (not with residual): returns post_add + rmsnorm(x), a post-norm and its add.
    """
    if post_add is not None and residual is not None:
        raise ValueError("rmsnorm takes a residual (pre-norm) or a post_add (post-norm), not both")
    if x.dim() != 2:
        raise ValueError(f"x must be [T, N], got {tuple(x.shape)}")
    num_rows, n = x.shape
    if weight.shape != (n,):
        raise ValueError(f"weight must be [{n}], got {tuple(weight.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"x must be fp16, bf16 or fp32, got {x.dtype}")
    if n > MAX_HIDDEN:
        raise ValueError(f"hidden size up to {MAX_HIDDEN} is supported, got {n}")
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    out = torch.empty_like(x)
    has_residual = residual is not None
    if post_add is not None:
        if post_add.shape != x.shape or post_add.dtype != x.dtype:
            raise ValueError(f"post_add {post_add.dtype} {tuple(post_add.shape)} must match x "
                             f"{x.dtype} {tuple(x.shape)}")
        check_last_dim_contiguous("post_add", post_add)
        residual, residual_out = post_add, out  # read as the addend; nothing else written
    elif has_residual:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual {residual.dtype} {tuple(residual.shape)} must match x "
                             f"{x.dtype} {tuple(x.shape)}")
        check_last_dim_contiguous("residual", residual)
        residual_out = torch.empty_like(x)
    else:
        residual, residual_out = x, out  # unused
    if num_rows > 0:
        block = next_power_of_2(n)
        num_warps = 16 if block >= 16384 else 8 if block >= 4096 else 4 if block >= 1024 else 2
        _rmsnorm_kernel[(num_rows,)](
            out, x, residual, residual_out, weight,
            x.stride(0), residual.stride(0), out.stride(0), residual_out.stride(0), n, eps,
            BLOCK=block, HAS_RESIDUAL=has_residual, POST_ADD=post_add is not None, num_warps=num_warps,
            **pdl_launch(x.device),
        )
    return (out, residual_out) if has_residual else out


# --------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------

def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                residual: Optional[torch.Tensor] = None, *, post_add: Optional[torch.Tensor] = None
                ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """HF LlamaRMSNorm, with the same cast order; same contract as rmsnorm."""
    if post_add is not None:
        return post_add + rmsnorm_ref(x, weight, eps)
    if residual is not None:
        residual = x + residual
        x = residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = (weight * h.to(x.dtype)).to(x.dtype)
    return out if residual is None else (out, residual)


def rmsnorm_bytes(num_rows: int, hidden: int, elem_bytes: int, has_residual: bool,
                  weight_bytes: Optional[int] = None) -> int:
    """Bytes rmsnorm must move: each input read once, each output written once."""
    tensors = 4 if has_residual else 2
    return tensors * num_rows * hidden * elem_bytes + hidden * (weight_bytes or elem_bytes)
