"""LoRA shrink: h = x @ A_slot^T for every token under an adapter, in Triton (Punica's SGMV/BGMV).

Algorithm
---------
A batch mixes tokens of many adapters and of none. Each adapter lives in a slot of a fixed pool:
lora_a [S, N, K] holds slot s's A matrices (a fused linear's shards stacked along N: q, k, v
each rank R rows, so N = shards x R). The step's mapping (rooflm/lora/mapping.py) lists the
tokens under an adapter grouped by slot: segment g is token_order[seg_starts[g]:seg_starts[g+1]],
all under slot seg_slots[g].

  * SGMV (prefill and mixed steps): one program per (segment, N block, M block) gathers
    BLOCK_M of the segment's token rows of x and multiplies them by the slot's A tile with
    tl.dot, so a slot's A is read once per BLOCK_M tokens, not once per token.
  * BGMV (steps of decodes only): one program per (token, N block, K split) reduces x_t
    against the rows of its slot's A (a GEMV); the few slots' A stay in L2 across the batch.
    K is split so that a small batch still fills the GPU: at batch 1 one program per token
    would stream a whole A ([48, 4096] bf16, 384 KiB) alone, ~6 us; 16 splits take ~1 us. Each
    split writes its partial sums; lora_expand adds them as it reads h (no atomics: the sum's
    order is fixed, so graphs and eager steps agree bit for bit).

h is fp32 [S, T, N] partial sums (S = 1 for SGMV); rows of tokens without an adapter are
undefined (the expand skips them).

Shapes
------
x [T, K] (unit last stride), lora_a [S, N, K] with each slot contiguous (any slot stride: the
hooks' are views into one pool whose row is a whole adapter), token_order/seg_starts/seg_slots int32.

Work
----
FLOPs: 2 * Ta * N * K (Ta: tokens under an adapter). With N = 3 x 16 and K = 4096 this is tiny
beside the base linear (N_base = 6144): the kernel is memory-bound.
Bytes: Ta * K * e (x) + segments * N * K * e (A; BGMV: per token, mostly from L2) + Ta * N * 4 (h).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from rooflm.kernels.utils import check_last_dim_contiguous


# --------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------

@triton.jit
def _sgmv_shrink_kernel(x_ptr, a_ptr, h_ptr, order_ptr, starts_ptr, slots_ptr, N, K,
                        stride_xm, stride_as, stride_an, stride_hm,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    g = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_m = tl.program_id(2)
    start = tl.load(starts_ptr + g)
    end = tl.load(starts_ptr + g + 1)
    slot = tl.load(slots_ptr + g).to(tl.int64)
    rows = start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < end  # a program past its segment's end masks everything
    tok = tl.load(order_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        xt = tl.load(x_ptr + tok[:, None] * stride_xm + offs_k[None, :],
                     mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(a_ptr + slot * stride_as + offs_n[:, None] * stride_an + offs_k[None, :],
                     mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(xt, tl.trans(at.to(xt.dtype)))
    tl.store(h_ptr + tok[:, None] * stride_hm + offs_n[None, :], acc, mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _bgmv_shrink_kernel(x_ptr, a_ptr, h_ptr, order_ptr, token_slots_ptr, N, K, K_PER_SPLIT,
                        stride_xm, stride_as, stride_an, stride_hs, stride_hm,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DENSE: tl.constexpr):
    # DENSE (a CUDA graph's decode rows): one program per row, whatever its slot, so the grid
    # is the graph's batch; a row without an adapter (slot -1, padding too) does nothing.
    if DENSE:
        tok = tl.program_id(0).to(tl.int64)
    else:
        tok = tl.load(order_ptr + tl.program_id(0)).to(tl.int64)
    slot = tl.load(token_slots_ptr + tok).to(tl.int64)
    if slot >= 0:
        split = tl.program_id(2)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K_PER_SPLIT, BLOCK_K):
            offs_k = split * K_PER_SPLIT + k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            xk = tl.load(x_ptr + tok * stride_xm + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            at = tl.load(a_ptr + slot * stride_as + offs_n[:, None] * stride_an + offs_k[None, :],
                         mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(at * xk[None, :], axis=1)
        tl.store(h_ptr + split * stride_hs + tok * stride_hm + offs_n, acc, mask=n_ok)


# --------------------------------------------------------------------------
# Wrapper
# --------------------------------------------------------------------------

def slots_contiguous(t: torch.Tensor) -> bool:
    """Each slot's matrix contiguous; the slot stride is free (a view into the slot pool)."""
    return t.stride(2) == 1 and t.stride(1) == t.shape[2] and t.stride(0) >= t.shape[1] * t.shape[2]


def decode_splits(num_tokens: int, n: int, k: int, device: torch.device) -> int:
    """How many K splits a BGMV shrink takes: enough programs to fill the GPU twice over when
    the batch is small (at batch 1 one program would stream all of A alone), each split at
    least MIN_SPLIT_K long. A function of the shapes only, so a captured graph keeps it."""
    programs = num_tokens * triton.cdiv(n, 64)
    target = 2 * _num_sms(device)
    return max(1, min(triton.cdiv(k, MIN_SPLIT_K), target // max(programs, 1)))


MIN_SPLIT_K = 256


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits, so the tests cover them
    return torch.cuda.get_device_properties(device).multi_processor_count


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor,
                token_order: Optional[torch.Tensor], seg_starts: Optional[torch.Tensor],
                seg_slots: Optional[torch.Tensor], max_seg_len: int, decode_only: bool,
                num_splits: Optional[int] = None) -> torch.Tensor:
    """Partial sums h [S, T, N] fp32 whose sum over S is x_t @ A_{slot(t)}^T, for the tokens in
    token_order (rows of other tokens are undefined: the expand never reads them). S = 1 for
    SGMV; the BGMV kernel splits K over S programs per token (decode_splits, or num_splits),
    and lora_expand adds the partials as it reads them.
    token_order None (a CUDA graph's decode step, decode_only): every row of x is a program that
    reads its slot from token_slots and skips slot -1, a launch grid fixed by T alone."""
    check_last_dim_contiguous("x", x)
    if lora_a.dim() != 3 or lora_a.shape[2] != x.shape[1] or not slots_contiguous(lora_a):
        raise ValueError(f"lora_a must be [slots, N, {x.shape[1]}], each slot contiguous, got "
                         f"{tuple(lora_a.shape)} with strides {lora_a.stride()}")
    t, k = x.shape
    n = lora_a.shape[1]
    dense = token_order is None
    if dense and not decode_only:
        raise ValueError("lora_shrink without token_order (every row) is the decode-only kernel")
    num_tokens = t if dense else token_order.numel()
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    if decode_only:
        splits = num_splits or decode_splits(num_tokens, n, k, x.device)
        k_per_split = triton.cdiv(k, splits)
        block_k = min(128, max(16, triton.next_power_of_2(k_per_split)))
        k_per_split = triton.cdiv(k_per_split, block_k) * block_k
        splits = triton.cdiv(k, k_per_split)
        # No memset: every split of every token under an adapter writes its row.
        h = torch.empty(splits, t, n, dtype=torch.float32, device=x.device)
        if num_tokens:
            grid = (num_tokens, triton.cdiv(n, block_n), splits)
            _bgmv_shrink_kernel[grid](x, lora_a, h, token_slots if dense else token_order, token_slots, n, k,
                                      k_per_split, x.stride(0), lora_a.stride(0), lora_a.stride(1),
                                      h.stride(0), h.stride(1), BLOCK_N=block_n, BLOCK_K=block_k, DENSE=dense)
        return h
    h = torch.empty(1, t, n, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return h
    block_k = min(128, max(16, triton.next_power_of_2(k)))
    block_m = 16 if max_seg_len <= 16 else 32
    grid = (seg_slots.numel(), triton.cdiv(n, block_n), triton.cdiv(max_seg_len, block_m))
    _sgmv_shrink_kernel[grid](x, lora_a, h, token_order, seg_starts, seg_slots, n, k, x.stride(0),
                              lora_a.stride(0), lora_a.stride(1), h.stride(1),
                              BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return h


# --------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------

def lora_shrink_ref(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """h [T, N] fp32: x_t @ A_{slot(t)}^T where slot(t) >= 0, zeros elsewhere."""
    h = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    for slot in token_slots.unique().tolist():
        if slot < 0:
            continue
        idx = (token_slots == slot).nonzero().flatten()
        h[idx] = x[idx].float() @ lora_a[slot].float().T
    return h


def shrink_total(h: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """lora_shrink's partial sums [S, T, N] as the whole [T, N] the reference gives: summed,
    rows of tokens without an adapter (undefined in h) zero."""
    under = (token_slots >= 0).unsqueeze(1)
    return torch.where(under, h.sum(0), torch.zeros((), dtype=h.dtype, device=h.device))
