"""W8A16: y = x @ W.T with W as int8 codes and one scale (and zero point) per output row, in Triton.

Why
---
Batch-1 decode streams every weight each step; int8 halves bf16's bytes (gpt-fast's int8
weight-only path: 173 -> 234 tokens/s on the project's H100). A per-channel scale factors out
of the sum over K, so the codes are multiplied as they are and scaled once in the epilogue:

    y[m, n] = s[n] * (sum_k x[m, k] q[n, k] - z[n] sum_k x[m, k])

The zero term is zero for symmetric checkpoints (rooflm's RTN, GPTQ sym); GPTQ's asymmetric
8-bit per-channel weights need it. int8 codes are exact in bf16/fp16 (|q| <= 128 < 2^8), so the
tensor-core path multiplies the exact codes.

Group-wise scales (_w8a16_grouped: GGUF Q8_0 is int8 with one fp16 scale per block of 32 inputs)
do not factor out of the whole sum, only out of each group's. The GEMV scales each weight as it
is loaded, (q - z[g, n]) s[g, n] (one FMA with per-row constants of the group, as w4a16's GEMV);
the tensor-core path takes one dot a group and scales its [BLOCK_M, BLOCK_N] result:
y[m, n] = sum_g s[g, n] (sum_{k in g} x[m, k] q[n, k] - z[g, n] sum_{k in g} x[m, k]).

Layout
------
  qweight int8 [N, K] (nn.Linear's row-major: a program's BLOCK_N rows are contiguous along K)
  scales  [N] float, zeros [N] float (code units)
          or, group-wise, [K / g, N] each (group-major, as w4a16's: BLOCK_N values one load)

Algorithm
---------
Each program owns BLOCK_N rows of W, BLOCK_M rows of x and one of SPLIT_K ranges of K (split-K:
at batch 1 a narrow layer has too few row blocks to keep 132 SMs' loads in flight; the fp32
partials are summed by rooflm/kernels/split_k.py), walking its range in BLOCK_K tiles:
M == 1 accumulates the [BLOCK_N, BLOCK_K] products in fp32 and reduces once (GEMV), the codes
made float without an int->float convert (slow pipe): q + 128 added to the bit pattern of 2^23
reads as the float 2^23 + 128 + q, exact, and one subtract leaves q. M > 1 uses tl.dot on codes
converted to the activation dtype, fp32 accumulator.

Work
----
FLOPs 2 M N K. Bytes N K (codes) + 2 * 2 N (scale, zero) + 2 M K + 2 M N: the weight's bytes
dominate at decode batch sizes.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from rooflm.kernels.split_k import split_for, split_k_reduce
from rooflm.kernels.tuned_configs import device_facts, lookup
from rooflm.kernels.utils import gdc_launch_dependents, gdc_wait, is_interpreter, pdl_launch

# The bits of the float 2^23 + 128: an int8 code q added to them reads as 2^23 + 128 + q.
MAGIC_BITS_Q8 = tl.constexpr(0x4B000080)
MAGIC_F32_Q8 = tl.constexpr(8388736.0)


# --------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------

@triton.jit
def _w8a16_kernel(y_ptr, ws_ptr, x_ptr, qw_ptr, s_ptr, z_ptr, M, N, K, CHUNK, stride_xm, stride_ym,
                  HAS_ZERO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                  STAGES: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # launched early (programmatic dependent launch): wait for the kernel before's x
        gdc_wait()
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rk = tl.arange(0, BLOCK_K)
    start = pid_k * CHUNK  # CHUNK is a multiple of BLOCK_K: only the last range meets K's tail
    end = tl.minimum(start + CHUNK, K)
    scale = tl.load(s_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    if BLOCK_M == 1:
        x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        xsum = tl.zeros([BLOCK_K], dtype=tl.float32)
        # tl.range's num_stages pipelines these loads (the kernel's num_stages only those feeding tl.dot)
        for k0 in tl.range(start, end, BLOCK_K, num_stages=STAGES):
            if EVEN_K:
                q = tl.load(qw_ptr + rn[:, None] * K + (k0 + rk)[None, :], mask=n_mask[:, None], other=0)
                x = tl.load(x_row + k0 + rk).to(tl.float32)
            else:
                k_mask = (k0 + rk) < K
                q = tl.load(qw_ptr + rn[:, None] * K + (k0 + rk)[None, :],
                            mask=n_mask[:, None] & k_mask[None, :], other=0)
                x = tl.load(x_row + k0 + rk, mask=k_mask, other=0.0).to(tl.float32)
            qf = (q.to(tl.int32) + MAGIC_BITS_Q8).to(tl.float32, bitcast=True) - MAGIC_F32_Q8
            acc += qf * x[None, :]
            if HAS_ZERO:
                xsum += x
        y = tl.sum(acc, axis=1)
        if HAS_ZERO:
            zero = tl.load(z_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
            y -= zero * tl.sum(xsum, axis=0)
        y *= scale
        if PDL:  # only now: a kernel launched at this one's start would hold SM slots its later waves need
            gdc_launch_dependents()
        if SPLIT:
            tl.store(ws_ptr + (pid_k * M + pid_m).to(tl.int64) * N + rn, y, mask=n_mask)
        else:
            tl.store(y_ptr + pid_m.to(tl.int64) * stride_ym + rn, y.to(y_ptr.dtype.element_ty), mask=n_mask)
    else:
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = rm < M
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        xsum = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for k0 in range(start, end, BLOCK_K):
            k_mask = (k0 + rk) < K
            q = tl.load(qw_ptr + rn[:, None] * K + (k0 + rk)[None, :],
                        mask=n_mask[:, None] & k_mask[None, :], other=0)
            x = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + (k0 + rk)[None, :],
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(q.to(x.dtype)), acc, input_precision=PRECISION)
            if HAS_ZERO:
                xsum += x.to(tl.float32)
        if HAS_ZERO:
            zero = tl.load(z_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
            acc -= tl.sum(xsum, axis=1)[:, None] * zero[None, :]
        acc *= scale[None, :]
        mn_mask = m_mask[:, None] & n_mask[None, :]
        if SPLIT:
            tl.store(ws_ptr + (pid_k * M + rm).to(tl.int64)[:, None] * N + rn[None, :], acc, mask=mn_mask)
        else:
            offs = rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
            tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mn_mask)


@triton.jit
def _w8a16_grouped(y_ptr, ws_ptr, x_ptr, qw_ptr, s_ptr, z_ptr, M, N, K, CHUNK, stride_xm, stride_ym,
                   HAS_ZERO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLIT: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr, STAGES: tl.constexpr,
                   GROUP: tl.constexpr):
    """The kernel with scales (and zeros) per group of GROUP inputs: BLOCK_K holds whole groups,
    K is a multiple of GROUP (the wrapper checks), so a group past K is all masked: zero codes,
    zero x, zero scale."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    start = pid_k * CHUNK
    end = tl.minimum(start + CHUNK, K)
    if BLOCK_M == 1:
        x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
        rgk = tl.arange(0, GROUP)
        # One group a step, as w4a16's GEMV: (q - z) s = fma(q, s, -z s) with per-row constants of
        # the group, then one FMA into an elementwise [BLOCK_N, GROUP] accumulator reduced once at
        # the end (no per-step reduction or reshape). Steps start on group boundaries and stop at
        # end <= K, a multiple of GROUP: no mask along K. BLOCK_K / GROUP steps are unrolled.
        acc = tl.zeros([BLOCK_N, GROUP], dtype=tl.float32)
        for k0 in tl.range(start, end, GROUP, num_stages=STAGES, loop_unroll_factor=BLOCK_K // GROUP):
            s = tl.load(s_ptr + (k0 // GROUP) * N + rn, mask=n_mask, other=0.0).to(tl.float32)
            q = tl.load(qw_ptr + rn[:, None] * K + (k0 + rgk)[None, :], mask=n_mask[:, None], other=0)
            x = tl.load(x_row + k0 + rgk).to(tl.float32)
            qf = (q.to(tl.int32) + MAGIC_BITS_Q8).to(tl.float32, bitcast=True) - MAGIC_F32_Q8
            if HAS_ZERO:
                z = tl.load(z_ptr + (k0 // GROUP) * N + rn, mask=n_mask, other=0.0).to(tl.float32)
                w = tl.fma(qf, s[:, None], (-z * s)[:, None])
            else:
                w = qf * s[:, None]
            acc = tl.fma(w, x[None, :], acc)
        y = tl.sum(acc, axis=1)
        if SPLIT:
            tl.store(ws_ptr + (pid_k * M + pid_m).to(tl.int64) * N + rn, y, mask=n_mask)
        else:
            tl.store(y_ptr + pid_m.to(tl.int64) * stride_ym + rn, y.to(y_ptr.dtype.element_ty), mask=n_mask)
    else:
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = rm < M
        rgk = tl.arange(0, GROUP)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        # one tl.dot a group, scaled (and its zero term taken off) before it joins the accumulator
        for k0 in range(start, end, BLOCK_K):
            for gi in tl.static_range(GROUPS):
                kk = k0 + gi * GROUP
                k_mask = (kk + rgk) < K
                q = tl.load(qw_ptr + rn[:, None] * K + (kk + rgk)[None, :],
                            mask=n_mask[:, None] & k_mask[None, :], other=0)
                x = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + (kk + rgk)[None, :],
                            mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                d = tl.dot(x, tl.trans(q.to(x.dtype)), input_precision=PRECISION)
                # (a scalar condition broadcast by hand: the interpreter's masks must be tensors)
                kb = tl.zeros([BLOCK_N], dtype=tl.int32) + kk
                g_mask = n_mask & (kb < K)
                s = tl.load(s_ptr + (kk // GROUP) * N + rn, mask=g_mask, other=0.0).to(tl.float32)
                if HAS_ZERO:
                    z = tl.load(z_ptr + (kk // GROUP) * N + rn, mask=g_mask, other=0.0).to(tl.float32)
                    d -= tl.sum(x.to(tl.float32), axis=1)[:, None] * z[None, :]
                acc += d * s[None, :]
        mn_mask = m_mask[:, None] & n_mask[None, :]
        if SPLIT:
            tl.store(ws_ptr + (pid_k * M + rm).to(tl.int64)[:, None] * N + rn[None, :], acc, mask=mn_mask)
        else:
            offs = rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
            tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mn_mask)


# --------------------------------------------------------------------------
# Wrapper
# --------------------------------------------------------------------------

class W8Config(NamedTuple):
    block_m: int      # 1: the GEMV path; >= 16: tensor-core tiles
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1  # programs per row block along K (fp32 partials, then one sum)


def check_config(cfg: W8Config, group_size: int = 0) -> None:
    """Raise on tiles the kernel cannot take (a hand-made or tabled config)."""
    pow2 = all(v > 0 and v & (v - 1) == 0 for v in (cfg.block_m, cfg.block_n, cfg.block_k))
    if not pow2 or (cfg.block_m != 1 and min(cfg.block_m, cfg.block_n, cfg.block_k) < 16) \
            or min(cfg.split_k, cfg.num_warps, cfg.num_stages) < 1:
        raise ValueError(f"W8A16 config {cfg}: block sizes must be powers of two (block_m 1, or block_m, "
                         f"block_n, block_k >= 16 for tensor cores) and split_k, warps, stages >= 1")
    if group_size and cfg.block_k % group_size:
        raise ValueError(f"W8A16 config {cfg}: block_k must hold whole groups of {group_size}")


@functools.lru_cache(maxsize=256)
def pick_config(m: int, n: int, k: int, device_name: Optional[str] = None, sms: int = 132,
                group_size: int = 0) -> W8Config:
    """The measured tiles of rooflm/kernels/tuned/weight_only.json for this GPU and shape, else as
    w4a16.pick_config: narrow row blocks and split-K to fill the SMs at M == 1, tensor-core tiles above.
    Group-wise scales take the heuristic (the table was measured per-channel), block_k >= the group."""
    if group_size:
        cfg = pick_config(m, n, k, None, sms)
        if cfg.block_k < group_size:
            cfg = cfg._replace(block_k=group_size,
                               split_k=min(cfg.split_k, max(1, -(-k // group_size))))
        return cfg
    tabled = lookup("w8a16", device_name, n, k, m)
    if tabled is not None:
        cfg = W8Config(**tabled)
        check_config(cfg)
        return cfg
    if m == 1:  # 32 x 512 tiles: ~4.8 instructions a weight against ~6.3 at 16 x 256 (sm_90 SASS)
        return W8Config(1, 32, 512, 4, 3, split_for(-(-n // 32), -(-k // 512), sms))
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 32 if m <= 16 else 64
    return W8Config(block_m, block_n, 128, 4, 3,
                    split_for(-(-n // block_n) * -(-m // block_m), -(-k // 128), sms))


def w8a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor | None = None, config: Optional[W8Config] = None,
                 group_size: int = 0) -> torch.Tensor:
    """x [M, K] @ W.T for int8 W [N, K] with per-row scales [N] (and zero points [N]), or with
    group_size > 0 scales (and zeros) [K / group_size, N], one per group of inputs and row.
    config: tiles to use instead of pick_config's (benchmarks sweep them)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    m, k = x.shape
    n = qweight.shape[0]
    if qweight.dtype != torch.int8 or qweight.shape[1] != k:
        raise ValueError(f"qweight must be int8 [N, K] with K={k}, got {qweight.dtype} {tuple(qweight.shape)}")
    if group_size:
        if group_size < 16 or group_size & (group_size - 1) or k % group_size:
            raise ValueError(f"group_size {group_size} must be a power of two >= 16 dividing K={k}")
        want = (k // group_size, n)
    else:
        want = (n,)
    if scales.shape != want or (zeros is not None and zeros.shape != want):
        raise ValueError(f"scales (and zeros) must be {list(want)}, got {tuple(scales.shape)}"
                         + ("" if zeros is None else f" and {tuple(zeros.shape)}"))
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    cfg = config or pick_config(m, n, k, *device_facts(x.device), group_size=group_size)
    check_config(cfg, group_size)
    iterations = triton.cdiv(k, cfg.block_k)
    per_split = triton.cdiv(iterations, cfg.split_k)
    split_k = triton.cdiv(iterations, per_split)  # no empty splits
    ws = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else y
    grid = (triton.cdiv(n, cfg.block_n), m if cfg.block_m == 1 else triton.cdiv(m, cfg.block_m), split_k)
    # group-wise scales: a kernel of their own (its loop sums per group), the same arguments
    kernel = _w8a16_grouped if group_size else _w8a16_kernel
    extra = {"GROUP": group_size} if group_size else {}
    kernel[grid](y, ws, x, qweight, scales, scales if zeros is None else zeros, m, n, k,
                 per_split * cfg.block_k, x.stride(0), y.stride(0), HAS_ZERO=zeros is not None,
                 BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=split_k > 1,
                 EVEN_K=k % cfg.block_k == 0,
                 PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=cfg.num_warps,
                 STAGES=1 if is_interpreter() else cfg.num_stages,
                 num_stages=1 if is_interpreter() else cfg.num_stages, **extra,
                 **(pdl_launch(x.device) if kernel is _w8a16_kernel and cfg.block_m == 1 else {}))
    if split_k > 1:
        split_k_reduce(y, ws)
    return y


# --------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------

def dequantize_w8(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None,
                  group_size: int = 0) -> torch.Tensor:
    """W [N, K] in fp32."""
    codes = qweight.float()
    if group_size:  # [K / g, N] -> one value per weight
        def spread(t):
            return t.float().T.repeat_interleave(group_size, dim=1)
        return (codes - (0.0 if zeros is None else spread(zeros))) * spread(scales)
    if zeros is not None:
        codes = codes - zeros.float()[:, None]
    return codes * scales.float()[:, None]


def w8a16_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     zeros: torch.Tensor | None = None, group_size: int = 0) -> torch.Tensor:
    return (x.float() @ dequantize_w8(qweight, scales, zeros, group_size).T).to(x.dtype)


def w8a16_bytes(m: int, n: int, k: int, act_bytes: int = 2, group_size: int = 0) -> int:
    groups = k // group_size if group_size else 1
    return n * k + 2 * act_bytes * n * groups + act_bytes * (m * k + m * n)
