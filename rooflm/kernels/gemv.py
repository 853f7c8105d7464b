"""Batch-1 matrix-vector product (GEMV) with the decode step's neighbours fused in, in Triton.

Why
---
At batch 1 a decode step is ~4 weight GEMVs per layer, each reading its weight
once, plus a norm, an activation and residual adds that touch 4096-element
vectors. The small kernels cost little bandwidth but each one is a launch, a
ramp-up and a tail on the device (~2-4 us on an H100), and an 8B model has
32 layers. Folding them into the GEMVs leaves four weight-streaming kernels
per layer (plus RoPE/KV write and attention):

    qkv      = W_qkv  @ rmsnorm(h)                  NORM prologue (+ bias)
    h        = h + W_o @ attn                       RESIDUAL epilogue
    a        = silu(W_gate @ n) * (W_up @ n),
               n = rmsnorm(h)                       NORM prologue, GATED epilogue
    h        = h + W_down @ a                       RESIDUAL epilogue

Algorithm
---------
y[n] = sum_k W[n, k] * x[k] for W [N, K] row-major (nn.Linear's layout). Each
program owns BLOCK_N output rows and streams their weights in [BLOCK_N,
BLOCK_K] tiles, accumulating elementwise products in fp32 registers and
reducing over K once at the end. x is tiny (K elements) and every program
reads it from L2.

- NORM: each program first reduces sum(x^2) over all of x (from L2), then
  normalises each x tile as it loads it, with the casts of HF's RMSNorm
  (normalised value rounded to the dtype, times the weight, rounded again).
- GATED: W is [2N, K] (gate rows, then up rows); the program keeps two
  accumulators and writes silu(gate) * up with the silu_mul kernel's casts.
- RESIDUAL: y is rounded to the dtype, then added to residual[n] and rounded
  again, as torch's `x + residual` after a bf16 matmul.
- BIAS: added to the fp32 accumulator, the product then rounded to the dtype.
- LORA: the token's adapter delta added to the fp32 accumulator(s) before the bias, the
  activation and the residual add (y = W x + B_slot (A_slot x), x normed as the GEMV's own):
  h = A_slot x comes from rooflm.kernels.lora_shrink (K-split partial sums, its NORM taking
  the same pre-norm), each program sums h's splits once per shard its rows touch as an
  [R] vector and reduces its rows of B_slot against it. The slot is read on the device (a CUDA
  graph input), -1: no delta. So a one-token step with an adapter keeps the GEMV chain: one
  shrink launch per linear beside it, no expand launch.

Shapes
------
x [1, K] (or [K]), W [N, K] ([2N, K] when GATED), bias [N], residual [1, N],
norm weight [K]; out [1, N] in x's dtype (or out_dtype).

Work
----
FLOPs: 2*N*K (4*N*K gated), negligible against the bytes.
Bytes: N*K*e of weight (2*N*K*e gated) + K*e (x) + N*e (out) [+ N*e residual].
Memory-bound: the yardstick is weight bytes / time against the device's
bandwidth. An H100 reads ~3.0 TB/s, so Llama-3-8B's 15 GB need >= 5.0 ms.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rooflm import envs
from rooflm.kernels import tuned_configs
from rooflm.kernels.utils import check_last_dim_contiguous, gdc_launch_dependents, gdc_wait, is_interpreter, pdl_supported


# --------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------

@triton.jit
def _x_tile(x_ptr, norm_w_ptr, rk, K, rstd, dtype: tl.constexpr, EVEN: tl.constexpr, NORM: tl.constexpr):
    """x[rk] in fp32, RMS-normalised (HF's casts) when NORM."""
    if EVEN:
        xv = tl.load(x_ptr + rk).to(tl.float32)
    else:
        xv = tl.load(x_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
    if NORM:
        if EVEN:
            nw = tl.load(norm_w_ptr + rk).to(tl.float32)
        else:
            nw = tl.load(norm_w_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
        xv = ((xv * rstd).to(dtype).to(tl.float32) * nw).to(dtype).to(tl.float32)
    return xv


@triton.jit
def _w_tile(rows, rk, n_mask, K, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(rows + rk[None, :])
    return tl.load(rows + rk[None, :], mask=n_mask[:, None] & (rk < K)[None, :], other=0.0)


@triton.jit
def _lora_delta(rows, n_mask, h_ptr, b_ptr, slot, R, OFF1, OFF2, NUM_SPLITS, stride_hs, stride_bs, stride_bn,
                BLOCK_R: tl.constexpr):
    """[BLOCK_N] fp32: sum_r h[shard(row) R + r] * B[slot, row, r] for the output rows `rows`,
    shard(row) = (row >= OFF1) + (row >= OFF2); h's K-split partials summed in a fixed order."""
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    ok = n_mask & ((rows * 0 + slot) >= 0)  # a vector compare: the interpreter rejects a scalar bool mask
    bt = tl.load(b_ptr + tl.maximum(slot, 0) * stride_bs + rows[:, None] * stride_bn + offs_r[None, :],
                 mask=ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
    shard = (rows >= OFF1).to(tl.int32) + (rows >= OFF2).to(tl.int32)
    delta = 0.0 * rows.to(tl.float32)
    for s in range(tl.min(shard, 0), tl.max(shard, 0) + 1):
        hv = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for split in range(0, NUM_SPLITS):
            hv += tl.load(h_ptr + split * stride_hs + s * R + offs_r, mask=r_ok, other=0.0)
        delta = tl.where(shard == s, tl.sum(bt * hv[None, :], 1), delta)
    return delta


@triton.jit
def _gemv_kernel(out_ptr, x_ptr, w_ptr, bias_ptr, residual_ptr, norm_w_ptr,
                 N, K, stride_w, eps,
                 lora_h_ptr, lora_b_ptr, lora_slot_ptr, R, OFF1, OFF2, NUM_SPLITS,
                 stride_lhs, stride_lbs, stride_lbn,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
                 NORM: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
                 HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr, GELU_TANH: tl.constexpr = False,
                 LORA: tl.constexpr = False, BLOCK_R: tl.constexpr = 16):
    dtype = x_ptr.dtype.element_ty
    rn = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rn[:, None] * stride_w
    up_rows = w_rows + N * stride_w

    # The first weight tile does not depend on the kernel before this one: with programmatic
    # dependent launch it is loaded while that kernel drains, then gdc_wait makes its
    # outputs (x, residual) visible. Nothing is stored before the wait.
    if PDL:
        gdc_launch_dependents()
    w = _w_tile(w_rows, offs_k, n_mask, K, EVEN)
    if GATED:
        wu = _w_tile(up_rows, offs_k, n_mask, K, EVEN)
    if PDL:
        gdc_wait()

    rstd = 1.0
    if NORM:
        sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xv = _x_tile(x_ptr, norm_w_ptr, k0 + offs_k, K, 1.0, dtype, EVEN, False)
            sq += xv * xv
        rstd = 1.0 / tl.sqrt(tl.sum(sq, 0) / K + eps)

    xv = _x_tile(x_ptr, norm_w_ptr, offs_k, K, rstd, dtype, EVEN, NORM)
    acc = w.to(tl.float32) * xv[None, :]
    if GATED:
        acc_up = wu.to(tl.float32) * xv[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        rk = k0 + offs_k
        xv = _x_tile(x_ptr, norm_w_ptr, rk, K, rstd, dtype, EVEN, NORM)
        acc += _w_tile(w_rows, rk, n_mask, K, EVEN).to(tl.float32) * xv[None, :]
        if GATED:
            acc_up += _w_tile(up_rows, rk, n_mask, K, EVEN).to(tl.float32) * xv[None, :]

    y = tl.sum(acc, 1)
    if LORA:
        slot = tl.load(lora_slot_ptr).to(tl.int64)
        y += _lora_delta(rn, n_mask, lora_h_ptr, lora_b_ptr, slot, R, OFF1, OFF2, NUM_SPLITS,
                         stride_lhs, stride_lbs, stride_lbn, BLOCK_R)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    if GATED:
        gate = y.to(dtype).to(tl.float32)
        up = tl.sum(acc_up, 1)
        if LORA:  # the up rows follow the gate rows in B, as in W
            up_slot = tl.load(lora_slot_ptr).to(tl.int64)
            up += _lora_delta(rn + N, n_mask, lora_h_ptr, lora_b_ptr, up_slot, R, OFF1, OFF2, NUM_SPLITS,
                              stride_lhs, stride_lbs, stride_lbn, BLOCK_R)
        up = up.to(dtype).to(tl.float32)
        if GELU_TANH:  # Gemma: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), tanh(z) = 2 sigmoid(2z) - 1
            z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            act = (gate * tl.sigmoid(2.0 * z)).to(dtype).to(tl.float32)
        else:
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        y = act * up
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
        y = y.to(dtype).to(tl.float32) + r
    tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty), mask=n_mask)


# --------------------------------------------------------------------------
# Wrapper
# --------------------------------------------------------------------------

GATED_ACTS = ("silu", "gelu_tanh")  # gated=True's activations, model/spec.py's SILU and GELU_TANH


class LoRAEpilogue(NamedTuple):
    """One token's adapter delta for gemv's LORA epilogue (rooflm/lora/hook.py builds it)."""
    h: torch.Tensor  # [splits, T >= 1, shards x rank] fp32: lora_shrink's partial sums; row 0 is the token's
    lora_b: torch.Tensor  # [slots, rows, rank]: every slot's B, rows as the weight's (gated: gate, then up)
    token_slots: torch.Tensor  # [>= 1] int32 on the device: the token's slot at 0, -1 for none
    rank: int
    shard_starts: tuple[int, int]  # the weight rows where shards 1 and 2 begin (rows: none)


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Best of a 54-config sweep on the H100 for all four Llama-3-8B weight shapes (within 1% of each
# shape's own best): benchmarks/results/gemv-h100-20261121.
DEFAULT_CONFIG = GemvConfig(block_n=4, block_k=1024, num_warps=4, num_stages=2)


def pick_config(n: int, k: int, gated: bool, device_name: Optional[str] = None) -> GemvConfig:
    """Launch shape for an [n, k] GEMV: the GPU's measured entry for this weight shape in
    kernels/tuned/gemv.json (benchmarks/gemv_shapes.py writes it), else DEFAULT_CONFIG."""
    if is_interpreter():
        return GemvConfig(4, 64, 1, 1)  # small tiles keep the CPU interpreter quick
    if device_name is not None and envs.cached.ROOFLM_GEMV_TUNED:
        entry = tuned_configs.lookup_gemv(device_name, n, k, gated)
        if entry is not None:
            return GemvConfig(**entry)
    return DEFAULT_CONFIG


def gemv(x: torch.Tensor, weight: torch.Tensor, *, bias: Optional[torch.Tensor] = None,
         residual: Optional[torch.Tensor] = None, norm_weight: Optional[torch.Tensor] = None,
         eps: float = 1e-6, gated: bool = False, out_dtype: Optional[torch.dtype] = None,
         config: Optional[GemvConfig] = None, act: str = "silu",
         lora: Optional[LoRAEpilogue] = None) -> torch.Tensor:
    """y = weight @ f(x) for one token x [1, K] (or [K]); returns [1, N] (N = rows, or rows/2 gated).

    norm_weight: f = RMSNorm(norm_weight, eps), else f = identity. gated: y =
    act(gate) * up over weight's two row halves, act "silu" or "gelu_tanh" (Gemma's
    gelu_pytorch_tanh). residual [1, N]: y + residual. bias [N] (not with gated). lora: the
    token's adapter delta added to W @ f(x) before the rest (LoRAEpilogue). Inputs are not modified.
    """
    if act not in GATED_ACTS:
        raise ValueError(f"act must be one of {GATED_ACTS}, got {act!r}")
    k = x.shape[-1]
    if x.numel() != k:
        raise ValueError(f"gemv takes one token: x must be [1, K] or [K], got {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"weight must be [N, {k}], got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight dtype {weight.dtype} must match x's {x.dtype}")
    if gated and (weight.shape[0] % 2 or bias is not None):
        raise ValueError("gated gemv needs an even number of weight rows and no bias")
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    check_last_dim_contiguous("weight", weight)
    x = x.reshape(k).contiguous()
    for name, t, size in (("bias", bias, n), ("residual", residual, n), ("norm_weight", norm_weight, k)):
        if t is not None and t.numel() != size:
            raise ValueError(f"{name} must have {size} elements, got {tuple(t.shape)}")
    out = torch.empty(1, n, dtype=out_dtype or x.dtype, device=x.device)
    cfg = config or pick_config(n, k, gated, tuned_configs.device_facts(x.device)[0])
    even = n % cfg.block_n == 0 and k % cfg.block_k == 0
    dummy = x  # never read when its flag is off
    grid = (triton.cdiv(n, cfg.block_n),)
    pdl = pdl_supported(x.device)
    lora_args = _lora_args(lora, weight, dummy)
    _gemv_kernel[grid](
        out, x, weight,
        bias if bias is not None else dummy,
        residual.reshape(n).contiguous() if residual is not None else dummy,
        norm_weight if norm_weight is not None else dummy,
        n, k, weight.stride(0), eps, *lora_args,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN=even, NORM=norm_weight is not None,
        GATED=gated, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, PDL=pdl,
        GELU_TANH=gated and act == "gelu_tanh", LORA=lora is not None,
        BLOCK_R=max(2, triton.next_power_of_2(lora.rank)) if lora is not None else 16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **({"launch_pdl": True} if pdl else {}),
    )
    return out


def _lora_args(lora: Optional[LoRAEpilogue], weight: torch.Tensor, dummy: torch.Tensor) -> tuple:
    """The LORA epilogue's kernel arguments (placeholders, never read, without it)."""
    if lora is None:
        return (dummy, dummy, dummy, 0, 0, 0, 0, 0, 0, 0)
    h, b = lora.h, lora.lora_b
    if h.dim() != 3 or h.dtype != torch.float32 or h.stride(2) != 1:
        raise ValueError(f"lora.h must be fp32 [splits, T, shards x rank] partial sums, got {tuple(h.shape)} {h.dtype}")
    if b.dim() != 3 or b.shape[1] != weight.shape[0] or b.shape[2] != lora.rank or b.stride(2) != 1:
        raise ValueError(f"lora.lora_b must be [slots, {weight.shape[0]}, {lora.rank}], got {tuple(b.shape)}")
    off1, off2 = lora.shard_starts
    return (h, b, lora.token_slots, lora.rank, off1, off2, h.shape[0], h.stride(0), b.stride(0), b.stride(1))


# --------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------

def gemv_ref(x: torch.Tensor, weight: torch.Tensor, *, bias: Optional[torch.Tensor] = None,
             residual: Optional[torch.Tensor] = None, norm_weight: Optional[torch.Tensor] = None,
             eps: float = 1e-6, gated: bool = False, out_dtype: Optional[torch.dtype] = None,
             config: Optional[GemvConfig] = None, act: str = "silu") -> torch.Tensor:
    """The unfused layers gemv replaces (RMSNorm, F.linear, SiLU- or GELU-tanh-and-mul, residual add),
    with their casts; same contract as gemv. config is accepted and ignored."""
    from rooflm.kernels.rmsnorm import rmsnorm_ref

    x = x.reshape(1, -1)
    if norm_weight is not None:
        x = rmsnorm_ref(x, norm_weight, eps)
    y = F.linear(x, weight, bias)
    if gated:
        gate, up = y.chunk(2, dim=-1)
        a = F.gelu(gate.float(), approximate="tanh") if act == "gelu_tanh" else F.silu(gate.float())
        y = (a.to(x.dtype).float() * up.float()).to(x.dtype)
    if residual is not None:
        y = y + residual.reshape(1, -1)
    return y.to(out_dtype) if out_dtype is not None else y


def gemv_bytes(n: int, k: int, elem_bytes: int, gated: bool = False, residual: bool = False) -> int:
    """Bytes a gemv must move: the weight once, x, the output (and the residual)."""
    rows = 2 * n if gated else n
    return rows * k * elem_bytes + k * elem_bytes + n * elem_bytes * (2 if residual else 1)
