"""The fused mixture-of-experts MLP: two grouped GEMMs over the experts that have tokens, in Triton.

Algorithm
---------
Token t goes to top_k experts e = topk_ids[t, k] with weights w[t, k] (the router's), and

    out[t] = sum_k w[t, k] * down_e( act( gate_up_e(x[t]) ) )

with the expert weights stacked: w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I].
A per-expert loop of matmuls launches 2-3 kernels per expert with tokens and reads each of
them once; the fused path (vLLM's and SGLang's fused_moe design) runs the whole layer as:

  1. moe_align_block_size (moe_align.py): the T * top_k (token, k) pairs sorted by expert, each
     expert's run padded to BLOCK_M rows; every BLOCK_M-row block belongs to one expert.
  2. Grouped GEMM 1, gate_up with the activation fused in its epilogue: a program owns BLOCK_M
     pairs of one expert and BLOCK_N columns of I; it multiplies the pairs' x rows with both the
     gate rows and the up rows of its expert's w13 (two accumulators, the x tile loaded once)
     and writes act(gate, up) into h [T * top_k, I]. The [T * top_k, 2I] gate_up is never written.
  3. Grouped GEMM 2, down: the same blocks, h's rows times the expert's w2; the epilogue adds
     the expert's bias (gpt-oss) and multiplies by the pair's routing weight w[t, k]; it writes
     y [T * top_k, H].
  4. out = y.view(T, top_k, H).sum(1): a torch reduction (deterministic: no atomics).

Programs whose block lies past num_tokens_post_padded return at once: the launch grid is sized
from T, top_k and E only (a CUDA graph replays it), the routing decides which programs work.

Activations (epilogue of GEMM 1):
  silu       silu(gate) * up                                       (Mixtral, Qwen3-MoE, OLMoE)
  swigluoai  gate = min(gate, limit), up = clamp(up, -limit, limit),
             (up + 1) * gate * sigmoid(alpha * gate)               (gpt-oss; alpha 1.702, limit 7)

Work
----
N = T * top_k pairs, D = distinct experts with tokens (uniform routing: E (1 - (1 - top_k/E)^T)).
FLOPs:  6 N H I (2 N * 2I * H for gate_up, 2 N * I * H for down), plus the padding rows'.
Bytes:  weights D * 3 H I * e  (only the experts with tokens: the decode-time term)
        + activations N (H + 2 I + 2 H) * e + T H e (x rows read per pair, h written and read,
        y written and read by the sum, out written).
At batch 1 on Qwen3-30B-A3B's shape (E=128, top_k=8, H=2048, I=768, bf16) D = 8: the call
reads 75.5 MB of the layer's 1.21 GB of experts (16x less than a dense walk over all of them);
at batch 64, D ~ 126 of 128. Decode is bandwidth-bound until the pairs per active expert are
in the hundreds (arithmetic intensity ~ 2 N / D FLOP/byte in bf16); its floor is those bytes
over HBM bandwidth.

int4 experts (W4A16: GPTQ / AWQ / compressed-tensors checkpoints kept as codes)
-----------------------------------------------------------------------------
w13 / w2 are uint8 [E, rows, S] in the W4A16 kernels' packing (kernels/int4_pack.py): byte j of
a row holds input j (low nibble) and input S + j (high nibble), S half of K in whole groups; one
(scale, zero) per expert, group of g inputs and row: scales / zeros [E, K/g, rows], value =
(code - zero) * scale. Each K step loads one [BLOCK_K, BLOCK_N] byte tile, unpacks it into the
low and the high half's weights in registers (BLOCK_K divides g: one group a half), and does two
dots against x's two matching K ranges. A quarter of bf16's weight bytes (plus 2 scale/zero
values per g weights), the same dots.

Tiles
-----
A FusedMoeConfig per call (pick_config): BLOCK_M from the expected pairs per expert (small at
decode: padding rows cost FLOPs, not bytes), BLOCK_N from how many programs fill the GPU,
BLOCK_K, GROUP_M (L2 swizzle across M), num_warps, num_stages per GEMM. A measured table per
GPU (rooflm/kernels/tuned/fused_moe.json, read like tuned_configs.py's weight-only table) wins
over the heuristic.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rooflm.kernels.fp8_quant import FP8_DTYPE, per_token_fp8, per_token_fp8_ref
from rooflm.kernels.moe_align import moe_align_block_size, moe_align_block_size_triton
from rooflm.kernels.tuned_configs import device_facts, load_table

ACTIVATIONS = {"none": 0, "silu": 1, "swigluoai": 2}


# --------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------

@triton.jit
def _fused_moe_kernel(
    c_ptr, a_ptr, b_ptr, bias_ptr, topk_weights_ptr,
    sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
    a_scale_ptr, b_scale_ptr, b_zero_ptr,
    N, K, EM, num_valid_pairs,
    stride_am, stride_be, stride_bn, stride_cm, stride_bias_e, stride_bs_e,
    alpha, limit,
    SPLIT, NUM_GROUPS, stride_bs_g,
    TOP_K: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr, FP8_DOT: tl.constexpr,
    INT4: tl.constexpr = False, GROUP_SIZE: tl.constexpr = 1,
):
    """c[pair, n] = epilogue(sum_k a[pair // TOP_K, k] * b[expert, n, k]) for one expert's block.

    Gated (ACTIVATION > 0): b holds 2N rows per expert (gate rows [0, N), up rows [N, 2N)) and
    c = act(gate, up) has N columns. Rows of a are read through the pair ids: GEMM 1 reads x's
    row pair // top_k, GEMM 2 (TOP_K = 1) reads h's row pair."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(EM, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: GROUP_M row blocks walk the column blocks together, so an expert's weight
    # tiles are read from L2 by the blocks that share it (Triton's matmul tutorial).
    group = pid // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % group_size
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_size

    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return  # a block past the last expert's: no weights read
    offs_row = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_token_ids_ptr + offs_row).to(tl.int64)
    row_mask = pair < num_valid_pairs  # padding rows hold num_valid_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:  # an expert another rank holds (expert parallelism): contributes zero here
        zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty)
        tl.store(c_ptr + pair[:, None] * stride_cm + offs_n[None, :], zeros,
                 mask=row_mask[:, None] & n_mask[None, :])
        return

    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pair // TOP_K)[:, None] * stride_am + offs_k[None, :]
    # b[expert] is [rows, K] row-major; the tile is read as [BLOCK_K, BLOCK_N] (K along dim 0).
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    up_ptrs = b_ptrs + N * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if INT4:  # b: packed bytes [rows, SPLIT]; scales / zeros [NUM_GROUPS, rows] per expert
        s_ptrs = b_scale_ptr + expert * stride_bs_e + offs_n
        z_ptrs = b_zero_ptr + expert * stride_bs_e + offs_n
        for k in range(0, tl.cdiv(SPLIT, BLOCK_K)):
            k_lo = k * BLOCK_K
            hi_mask = SPLIT + k_lo + offs_k < K  # the high half past K is padding (K / g odd)
            a_lo = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
            a_hi = tl.load(a_ptrs + SPLIT, mask=row_mask[:, None] & hi_mask[None, :], other=0.0)
            g_lo = k_lo // GROUP_SIZE
            g_hi = (SPLIT + k_lo) // GROUP_SIZE
            w_lo, w_hi = _int4_tiles(b_ptrs, s_ptrs, z_ptrs, g_lo, g_hi, NUM_GROUPS, stride_bs_g, n_mask)
            acc = tl.dot(a_lo, w_lo.to(a_lo.dtype), acc, input_precision=PRECISION)
            acc = tl.dot(a_hi, w_hi.to(a_lo.dtype), acc, input_precision=PRECISION)
            if ACTIVATION > 0:  # the up rows: N rows further in the bytes, N columns in the scales
                u_lo, u_hi = _int4_tiles(up_ptrs, s_ptrs + N, z_ptrs + N, g_lo, g_hi, NUM_GROUPS, stride_bs_g,
                                         n_mask)
                acc_up = tl.dot(a_lo, u_lo.to(a_lo.dtype), acc_up, input_precision=PRECISION)
                acc_up = tl.dot(a_hi, u_hi.to(a_lo.dtype), acc_up, input_precision=PRECISION)
                up_ptrs += BLOCK_K
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
    else:
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=n_mask[None, :], other=0.0)
            else:
                k_mask = offs_k < K - k * BLOCK_K
                a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if FP8 and not FP8_DOT:  # e4m3 codes are exact in fp16; the products and sums as the fp8 MMA's
                a = a.to(tl.float16)
                b = b.to(tl.float16)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            if ACTIVATION > 0:
                if EVEN_K:
                    u = tl.load(up_ptrs, mask=n_mask[None, :], other=0.0)
                else:
                    u = tl.load(up_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                if FP8 and not FP8_DOT:
                    u = u.to(tl.float16)
                acc_up = tl.dot(a, u, acc_up, input_precision=PRECISION)
                up_ptrs += BLOCK_K
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K

    if FP8:
        a_scale = tl.load(a_scale_ptr + pair // TOP_K, mask=row_mask, other=0.0)
        scale_row = b_scale_ptr + expert * stride_bs_e
        acc *= a_scale[:, None] * tl.load(scale_row + offs_n, mask=n_mask, other=0.0)[None, :]
        if ACTIVATION > 0:
            acc_up *= a_scale[:, None] * tl.load(scale_row + N + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        bias_row = bias_ptr + expert * stride_bias_e
        acc += tl.load(bias_row + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if ACTIVATION > 0:
            acc_up += tl.load(bias_row + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION == 1:  # silu(gate) * up
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    elif ACTIVATION == 2:  # gpt-oss: clamped SwiGLU with (up + 1)
        gate = tl.minimum(acc, limit)
        up = tl.minimum(tl.maximum(acc_up, -limit), limit)
        acc = (up + 1.0) * gate / (1.0 + tl.exp(-alpha * gate))
    if MUL_ROUTED_WEIGHT:
        w = tl.load(topk_weights_ptr + pair, mask=row_mask, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    tl.store(c_ptr + pair[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _int4_tiles(b_ptrs, s_ptrs, z_ptrs, g_lo, g_hi, num_groups, stride_g, n_mask):
    """One [BLOCK_K, BLOCK_N] byte tile -> the low and the high half's weights in fp32,
    (code - zero) * scale with group g_lo's and g_hi's values. g_hi past the last group is the
    padding of K / g odd: any finite weight does, x's matching columns are loaded as zeros."""
    packed = tl.load(b_ptrs, mask=n_mask[None, :], other=0)
    g_hi = tl.minimum(g_hi, num_groups - 1)
    s_lo = tl.load(s_ptrs + g_lo * stride_g, mask=n_mask, other=0.0).to(tl.float32)
    z_lo = tl.load(z_ptrs + g_lo * stride_g, mask=n_mask, other=0.0).to(tl.float32)
    s_hi = tl.load(s_ptrs + g_hi * stride_g, mask=n_mask, other=0.0).to(tl.float32)
    z_hi = tl.load(z_ptrs + g_hi * stride_g, mask=n_mask, other=0.0).to(tl.float32)
    w_lo = ((packed & 0xF).to(tl.float32) - z_lo[None, :]) * s_lo[None, :]
    w_hi = ((packed >> 4).to(tl.float32) - z_hi[None, :]) * s_hi[None, :]
    return w_lo, w_hi


# --------------------------------------------------------------------------
# Tiles
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class GemmTile:
    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class FusedMoeConfig:
    """block_m is shared by both GEMMs: it is the sorting's block size."""

    block_m: int
    gate_up: GemmTile
    down: GemmTile

    @classmethod
    def from_dict(cls, d: dict) -> "FusedMoeConfig":
        return cls(d["block_m"], GemmTile(**d["gate_up"]), GemmTile(**d["down"]))

    def to_dict(self) -> dict:
        return asdict(self)


TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned", "fused_moe.json")
ALIGN_TRITON_MAX_PAIRS = 512  # fused_moe's align: Triton's one launch up to here, torch's beyond


def lookup_tuned(device_name: Optional[str], num_experts: int, top_k: int, hidden: int, inter: int,
                 num_tokens: int, table: Optional[dict] = None) -> Optional[FusedMoeConfig]:
    """The measured config for this layer shape at the smallest tabled batch >= num_tokens (the
    largest past the table), or None. Table: {gpu: {"fused_moe": [{"e", "top_k", "h", "i", "m",
    "config": FusedMoeConfig.to_dict()}, ...]}}."""
    if device_name is None:
        return None
    table = load_table(TABLE_PATH) if table is None else table
    entries = [e for e in table.get(device_name, {}).get("fused_moe", [])
               if (e["e"], e["top_k"], e["h"], e["i"]) == (num_experts, top_k, hidden, inter)]
    if not entries:
        return None
    above = [e for e in entries if e["m"] >= num_tokens]
    best = min(above, key=lambda e: e["m"]) if above else max(entries, key=lambda e: e["m"])
    return FusedMoeConfig.from_dict(best["config"])


def _block_n_to_fill(columns: int, row_blocks: int, num_sms: int, largest: int) -> int:
    """The widest BLOCK_N (<= largest) that still gives two programs per SM, else 32: at decode
    a handful of experts' blocks must spread their weight reads over every SM."""
    block_n = largest
    while block_n > 32 and row_blocks * triton.cdiv(columns, block_n) < 2 * num_sms:
        block_n //= 2
    return block_n


def default_config(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int,
                   num_sms: int = 132) -> FusedMoeConfig:
    """Tiles for an H100/H200 by the expected pairs per expert (uniform routing)."""
    pairs = num_tokens * top_k
    per_expert = pairs / num_experts
    active = min(num_experts, pairs)
    if per_expert <= 16:  # decode: a block's rows are mostly one or two tokens; weights dominate
        block_m = 16
        row_blocks = max(1, active)
        return FusedMoeConfig(
            block_m,
            GemmTile(_block_n_to_fill(inter, row_blocks, num_sms, 64), 128, 1, 4, 4),
            GemmTile(_block_n_to_fill(hidden, row_blocks, num_sms, 128), 128, 1, 4, 4))
    if per_expert <= 64:
        return FusedMoeConfig(32, GemmTile(64, 64, 8, 4, 4), GemmTile(128, 64, 8, 4, 4))
    if per_expert <= 256:
        return FusedMoeConfig(64, GemmTile(64, 64, 8, 4, 3), GemmTile(128, 64, 8, 4, 3))
    # Two [128, 64] fp32 accumulators in gate_up: eight warps keep them in registers.
    return FusedMoeConfig(128, GemmTile(64, 64, 8, 8, 3), GemmTile(128, 64, 8, 8, 3))


def pick_config(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int,
                device: torch.device) -> FusedMoeConfig:
    name, num_sms = device_facts(device)
    tuned = lookup_tuned(name, num_experts, top_k, hidden, inter, num_tokens)
    return tuned if tuned is not None else default_config(num_tokens, num_experts, top_k, hidden, inter, num_sms)


# --------------------------------------------------------------------------
# Wrapper
# --------------------------------------------------------------------------

def _check_inputs(x, w13, w2, topk_weights, topk_ids, b13, b2, activation, w13_scale=None, w2_scale=None) -> bool:
    """Raises on inconsistent inputs; returns whether the experts are FP8 (codes + scales)."""
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"expected x [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    num_experts, two_i, hidden = w13.shape
    if x.shape[1] != hidden or two_i % 2 or tuple(w2.shape) != (num_experts, hidden, two_i // 2):
        raise ValueError(f"shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} "
                         f"(need w13 [E, 2I, H], w2 [E, H, I])")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"x must be fp16, bf16 or fp32, got {x.dtype}")
    fp8 = w13_scale is not None or w2_scale is not None
    if fp8:
        if w13.dtype != FP8_DTYPE or w2.dtype != FP8_DTYPE or w13_scale is None or w2_scale is None:
            raise TypeError(f"fp8 experts need float8_e4m3fn w13 and w2 and both scales; got w13 {w13.dtype}, "
                            f"w2 {w2.dtype}, w13_scale {'set' if w13_scale is not None else None}, "
                            f"w2_scale {'set' if w2_scale is not None else None}")
        if (tuple(w13_scale.shape) != tuple(w13.shape[:2]) or tuple(w2_scale.shape) != tuple(w2.shape[:2])
                or w13_scale.dtype != torch.float32 or w2_scale.dtype != torch.float32
                or w13_scale.stride(-1) != 1 or w2_scale.stride(-1) != 1):
            raise ValueError(f"fp8 scales must be fp32 per output channel, w13_scale {tuple(w13.shape[:2])} and "
                             f"w2_scale {tuple(w2.shape[:2])}; got {tuple(w13_scale.shape)} {w13_scale.dtype}, "
                             f"{tuple(w2_scale.shape)} {w2_scale.dtype}")
    elif w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise TypeError(f"weights must be x's dtype {x.dtype}, got w13 {w13.dtype}, w2 {w2.dtype}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [T, top_k] with T = {x.shape[0]}")
    if activation not in ("silu", "swigluoai"):
        raise ValueError(f"activation must be 'silu' or 'swigluoai', got {activation!r}")
    for name, t in (("x", x), ("w13", w13), ("w2", w2)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit last stride, got strides {t.stride()}")
    if (b13 is not None and tuple(b13.shape) != (num_experts, two_i)) or (
            b2 is not None and tuple(b2.shape) != (num_experts, hidden)):
        raise ValueError(f"biases must be b13 [E, 2I], b2 [E, H]; got "
                         f"{None if b13 is None else tuple(b13.shape)}, {None if b2 is None else tuple(b2.shape)}")
    return fp8


def _launch(c, a, b, bias, topk_weights, aligned, num_pairs, top_k, activation, mul_routed_weight,
            block_m, tile: GemmTile, alpha: float, limit: float, a_scale=None, b_scale=None,
            fp8_dot: bool = False, b_zero=None, group_size: int = 0) -> None:
    int4 = b_zero is not None  # b: packed uint8 [E, rows, S], b_scale / b_zero [E, K/g, rows]
    fp8 = b_scale is not None and not int4
    num_cols = c.shape[1]
    k_dim = a.shape[1]
    em = aligned.sorted_token_ids.numel()
    block_k = tile.block_k
    if int4:  # a K step's two halves each lie in one group
        while group_size % block_k:
            block_k //= 2
    grid = (triton.cdiv(em, block_m) * triton.cdiv(num_cols, tile.block_n),)
    _fused_moe_kernel[grid](
        c, a, b, bias if bias is not None else b, topk_weights,
        aligned.sorted_token_ids, aligned.expert_ids, aligned.num_tokens_post_padded,
        a_scale if fp8 else topk_weights, b_scale if b_scale is not None else topk_weights,
        b_zero if int4 else topk_weights,
        num_cols, k_dim, em, num_pairs,
        a.stride(0), b.stride(0), b.stride(1), c.stride(0), bias.stride(0) if bias is not None else 0,
        b_scale.stride(0) if b_scale is not None else 0,
        alpha, limit,
        b.shape[2] if int4 else 0, b_scale.shape[1] if int4 else 0, b_scale.stride(1) if int4 else 0,
        TOP_K=top_k, ACTIVATION=ACTIVATIONS[activation], HAS_BIAS=bias is not None,
        MUL_ROUTED_WEIGHT=mul_routed_weight,
        BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=block_k, GROUP_M=tile.group_m,
        EVEN_K=k_dim % block_k == 0, PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        FP8=fp8, FP8_DOT=fp8_dot, INT4=int4, GROUP_SIZE=group_size if int4 else 1,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )


def _check_int4(x, w13, w2, w13_scale, w2_scale, w13_zeros, w2_zeros, group_size: int) -> None:
    """int4 experts: packed codes, scales and zeros consistent with x [T, H] (the layout in the
    module docstring), every group whole and at least one tensor-core K step wide."""
    from rooflm.kernels.int4_pack import int4_split

    num_experts, two_i, _ = w13.shape
    hidden, inter = x.shape[1], two_i // 2
    if group_size < 16 or group_size & (group_size - 1) or hidden % group_size or inter % group_size:
        raise ValueError(f"int4 experts need a power-of-two group size >= 16 dividing H={hidden} and "
                         f"I={inter}; got {group_size}")
    want = {"w13": (w13, (num_experts, two_i, int4_split(hidden, group_size)), torch.uint8),
            "w2": (w2, (num_experts, hidden, int4_split(inter, group_size)), torch.uint8),
            "w13_scale": (w13_scale, (num_experts, hidden // group_size, two_i), None),
            "w13_zeros": (w13_zeros, (num_experts, hidden // group_size, two_i), None),
            "w2_scale": (w2_scale, (num_experts, inter // group_size, hidden), None),
            "w2_zeros": (w2_zeros, (num_experts, inter // group_size, hidden), None)}
    for name, (t, shape, dtype) in want.items():
        if t is None or tuple(t.shape) != shape or (dtype is not None and t.dtype != dtype) or not t.is_contiguous():
            raise ValueError(f"int4 experts: {name} must be a contiguous {dtype or 'float'} tensor {shape}; got "
                             f"{None if t is None else (tuple(t.shape), t.dtype)}")
    if w13_scale.shape != w13_zeros.shape or w2_scale.stride() != w2_zeros.stride():
        raise ValueError("int4 experts: scales and zeros must share their layout")


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, b13: Optional[torch.Tensor] = None, b2: Optional[torch.Tensor] = None,
              activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
              config: Optional[FusedMoeConfig] = None, align: Optional[Callable] = None,
              w13_scale: Optional[torch.Tensor] = None, w2_scale: Optional[torch.Tensor] = None,
              local_only: bool = False, w13_zeros: Optional[torch.Tensor] = None,
              w2_zeros: Optional[torch.Tensor] = None, group_size: int = 0) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) for x [T, H]; returns [T, H] in x's dtype.

    w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I], optional biases b13 [E, 2I], b2 [E, H];
    topk_ids [T, top_k] in [0, E). (A block whose expert_ids entry is -1, an expert another rank
    holds under expert parallelism, writes zeros: the kernel side of that later step.)
    align: moe_align_block_size's signature; None: the one-launch Triton one on CUDA, torch's
    elsewhere. FP8 experts (W8A8): w13 / w2 float8_e4m3fn codes with per-output-channel fp32
    scales w13_scale [E, 2I], w2_scale [E, H]; x and h are quantized per token on the way in
    (kernels/fp8_quant.py), two launches more than bf16's four.
    local_only (expert parallelism, layers/moe.py): topk_ids hold -1 for experts other ranks
    hold; those pairs are sorted nowhere and their rows stay zero (one memset more).
    int4 experts (W4A16): w13 / w2 uint8 packed codes [E, 2I, S_H] / [E, H, S_I], scales and
    zeros w13_scale / w13_zeros [E, H/g, 2I], w2_scale / w2_zeros [E, I/g, H], group_size g (the
    module docstring's layout); x stays in its dtype."""
    int4 = w13.dtype == torch.uint8
    if int4:
        _check_int4(x, w13, w2, w13_scale, w2_scale, w13_zeros, w2_zeros, group_size)
        fp8 = False
    else:
        fp8 = _check_inputs(x, w13, w2, topk_weights, topk_ids, b13, b2, activation, w13_scale, w2_scale)
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return torch.empty_like(x)
    cfg = config or pick_config(num_tokens, num_experts, top_k, hidden, inter, x.device)
    if align is None:
        # The one-launch Triton align walks every (token, expert) pair in one program: 9 us against
        # torch's 48 at one token, level at 64 tokens of top-8, 167 against 83 at 256 (H200,
        # benchmarks/results/parts-tuning-h200-20261129). Past 512 pairs torch's launches win.
        small = num_tokens * top_k <= ALIGN_TRITON_MAX_PAIRS
        align = moe_align_block_size_triton if x.is_cuda and small else moe_align_block_size
    aligned = align(topk_ids, cfg.block_m, num_experts)
    num_pairs = num_tokens * top_k
    weights = topk_weights.reshape(-1)
    if not weights.is_contiguous():
        weights = weights.contiguous()
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    y = (torch.zeros if local_only else torch.empty)(num_pairs, hidden, dtype=x.dtype, device=x.device)
    if int4:
        _launch(h, x, w13, b13, weights, aligned, num_pairs, top_k, activation, False, cfg.block_m, cfg.gate_up,
                alpha, limit, b_scale=w13_scale, b_zero=w13_zeros, group_size=group_size)
        _launch(y, h, w2, b2, weights, aligned, num_pairs, 1, "none", True, cfg.block_m, cfg.down, alpha, limit,
                b_scale=w2_scale, b_zero=w2_zeros, group_size=group_size)
    elif fp8:
        fp8_dot = fp8_dot_supported(x.device)
        qx, sx = per_token_fp8(x)
        _launch(h, qx, w13, b13, weights, aligned, num_pairs, top_k, activation, False, cfg.block_m, cfg.gate_up,
                alpha, limit, sx, w13_scale, fp8_dot)
        qh, sh = per_token_fp8(h)
        _launch(y, qh, w2, b2, weights, aligned, num_pairs, 1, "none", True, cfg.block_m, cfg.down, alpha, limit,
                sh, w2_scale, fp8_dot)
    else:
        _launch(h, x, w13, b13, weights, aligned, num_pairs, top_k, activation, False, cfg.block_m, cfg.gate_up,
                alpha, limit)
        _launch(y, h, w2, b2, weights, aligned, num_pairs, 1, "none", True, cfg.block_m, cfg.down, alpha, limit)
    return y.view(num_tokens, top_k, hidden).sum(dim=1)


def fp8_dot_supported(device: torch.device) -> bool:
    """tl.dot on float8e4nv operands: sm89+ (Ada, Hopper) and the interpreter; elsewhere the
    kernel upcasts the codes to fp16 tiles (the same products, on the fp16 tensor cores)."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


# --------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------

def expert_activation_ref(gate_up: torch.Tensor, activation: str, alpha: float = 1.702,
                          limit: float = 7.0) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


def fused_moe_ref(x, w13, w2, topk_weights, topk_ids, *, b13=None, b2=None, activation="silu",
                  alpha=1.702, limit=7.0) -> torch.Tensor:
    """The definition in fp32: every expert on every token, kept where the router chose it."""
    xf = x.float()
    out = torch.zeros_like(xf)
    for e in range(w13.shape[0]):
        chosen = (topk_ids == e).float() * topk_weights.float()  # [T, top_k]
        weight = chosen.sum(dim=1, keepdim=True)
        gate_up = xf @ w13[e].float().T + (0 if b13 is None else b13[e].float())
        y = expert_activation_ref(gate_up, activation, alpha, limit) @ w2[e].float().T
        y = y + (0 if b2 is None else b2[e].float())
        out += weight * y
    return out


def dequantize_int4_experts(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                            group_size: int, k: int) -> torch.Tensor:
    """Packed int4 experts [E, N, S] with scales / zeros [E, K/g, N] -> fp32 weights [E, N, K]."""
    from rooflm.kernels.int4_pack import unpack_int4
    codes = torch.stack([unpack_int4(p, k) for p in packed]).float()
    s = scales.float().transpose(1, 2).repeat_interleave(group_size, dim=2)
    z = zeros.float().transpose(1, 2).repeat_interleave(group_size, dim=2)
    return (codes - z) * s


def dequantize_fp8_experts(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[E, N, K] E4M3 codes and [E, N] scales -> fp32 weights."""
    return codes.float() * scales.float()[:, :, None]


def fake_quant_per_token(x: torch.Tensor) -> torch.Tensor:
    """x through per-token E4M3 and back (fp32): what the W8A8 GEMM multiplies."""
    q, scale = per_token_fp8_ref(x)
    return q.float() * scale


def fused_moe_fp8_ref(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, *, b13=None, b2=None,
                      activation="silu", alpha=1.702, limit=7.0) -> torch.Tensor:
    """The FP8 experts' definition in fp32: x quantized per token, the codes times their scales,
    h rounded to x's dtype (the kernel stores it so) and quantized per token, then down."""
    xq = fake_quant_per_token(x)
    w13f, w2f = dequantize_fp8_experts(w13, w13_scale), dequantize_fp8_experts(w2, w2_scale)
    out = torch.zeros_like(xq)
    for e in range(w13.shape[0]):
        weight = ((topk_ids == e).float() * topk_weights.float()).sum(dim=1, keepdim=True)
        gate_up = xq @ w13f[e].T + (0 if b13 is None else b13[e].float())
        h = expert_activation_ref(gate_up, activation, alpha, limit).to(x.dtype)
        y = fake_quant_per_token(h) @ w2f[e].T + (0 if b2 is None else b2[e].float())
        out += weight * y
    return out


# --------------------------------------------------------------------------
# Counting
# --------------------------------------------------------------------------

def expected_active_experts(num_tokens: int, num_experts: int, top_k: int) -> float:
    """Distinct experts a batch touches under uniform routing: E (1 - (1 - top_k / E)^T)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def fused_moe_bytes(num_tokens: int, active_experts: float, top_k: int, hidden: int, inter: int,
                    elem_bytes: int, fp8: bool = False) -> float:
    """HBM bytes of one fused MoE layer call: the active experts' weights once, plus activations.
    fp8: one-byte weights with an fp32 scale per output channel (2I + H an expert), and the
    per-token quantization's reads and writes of x and h (codes and scales)."""
    pairs = num_tokens * top_k
    activations = (pairs * (hidden + 2 * inter + 2 * hidden) + num_tokens * hidden) * elem_bytes
    if not fp8:
        return active_experts * 3 * hidden * inter * elem_bytes + activations
    weights = active_experts * (3 * hidden * inter + 4 * (2 * inter + hidden))
    quantize = num_tokens * (hidden * (elem_bytes + 1) + 4) + pairs * (inter * (elem_bytes + 1) + 4)
    # the GEMMs read the one-byte codes of x and h instead of elem_bytes ones
    return weights + activations - (pairs * (hidden + inter)) * (elem_bytes - 1) + quantize


def fused_moe_flops(num_tokens: int, top_k: int, hidden: int, inter: int) -> int:
    """Useful FLOPs (padding rows not counted): 6 N H I for N = T * top_k pairs."""
    return 6 * num_tokens * top_k * hidden * inter
