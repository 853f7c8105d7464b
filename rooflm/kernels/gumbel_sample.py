"""Temperature sampling in one pass over the logits (the Gumbel-max draw), in Triton.

Why
---
The sampler's random path (layers/sampler.py) is seven torch kernels over the [N, V] logits: the
fp32 copy, / temperature, softmax, the Exponential(1) draw, its clamp, probs / q and the argmax,
each reading or writing N x V x 4 bytes. At ~320 rows of Llama-3's 128,256-token vocabulary that
was ~1.0 ms a step (an H100 profile of the FP8 model at temperature 1: a decode step is ~18.7
ms). Rows that only ask for a temperature need none of those intermediates: one kernel reads the
logits once and keeps a running argmax. Sampler.forward, H100, 323 rows: 963.6 -> 107.3 us; one
row 88.2 -> 38.7 (benchmarks/sampling.py, benchmarks/results/sampling-h100-20261127/).

Algorithm
---------
    token = argmax_i  l_i + T g_i,   g_i = -log(-log u_i),  u_i ~ U(0, 1)   (Philox: tl.rand4x)
with T the row's temperature, and T = 0 on greedy rows (the plain argmax). This is the
distribution the sampler's exponential race draws from: argmax p_i / q_i with q_i = -log u_i
~ Exponential(1) and p = softmax(l / T) is argmax l_i / T - log q_i = argmax l_i / T + g_i, and
scaling by T > 0 keeps the argmax. Ties go to the lowest index, as torch.argmax.

The noise comes from Philox keyed by a seed drawn from torch's CUDA generator each call (one
int32); each Philox counter gives four numbers (tl.rand4x), for four columns, since Philox's ten
rounds of 32-bit multiplies, not the bytes, bounded the first version (one number a call: ~220 us
for 323 x 128,256, ~380 GB/s). Every call and row draws fresh numbers, and
torch.manual_seed still fixes the run. The numbers are not torch's exponential_ stream, so a draw
differs from the torch path's for the same seed (the distribution is the same); seeded requests
(per-request generators) keep the torch path.

Shapes
------
logits [N, V] (fp32/bf16/fp16, last dim contiguous), noise_scale [N] fp32 -> token ids [N] int64.
Grid (N, S): program (row, s) scans columns [s C, (s + 1) C) in BLOCK chunks and writes its best
(score, index); torch picks each row's best of S. S splits short batches so the grid fills the GPU.

Work
----
N V e bytes read (e = the logits' element size); per value a quarter of a Philox call (ten rounds
of 32-bit multiplies), two SFU logs and a compare. At 323 x 128,256 bf16 it moves ~770 GB/s: the
integer work of Philox, not the bytes, is the bound.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from rooflm.kernels.utils import next_power_of_2

BLOCK = 4096  # columns a program loads per loop step (four sub-blocks, one Philox call each)
# Tuned on the H100 (rows 1-512 of 128,256 bf16 logits; benchmarks/sampling.py): short batches
# split their rows into more programs, up to ~32 an SM.
MIN_PROGRAMS = 4224
NUM_WARPS = 4
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _gumbel_scores(logits_row, u, cols, end, scale, FAST_LOG: tl.constexpr):
    """l + scale * g over one sub-block, -inf past the row's end; g = -log(-log u)."""
    mask = cols < end
    logit = tl.load(logits_row + cols, mask=mask, other=0.0).to(tl.float32)
    # u in [0, 1) (multiples of 2^-32): clamped away from 0, -log u lies in (0, 70], so g is finite
    # and 0 * g = 0. (The bound is a normal fp32 number: a subnormal literal would make Triton use fp64.)
    u = tl.maximum(u, 1.0e-30)
    if FAST_LOG:  # lg2.approx (the SFU) instead of libdevice's logf: ~25 fewer instructions a log
        g = -libdevice.fast_logf(-libdevice.fast_logf(u))
    else:  # Triton's interpreter has no fast_logf
        g = -tl.log(-tl.log(u))
    return tl.where(mask, logit + scale * g, float("-inf"))


@triton.jit
def _best(score, first_col, best_val, best_idx):
    """The running (max, first argmax) after one more sub-block starting at first_col."""
    m = tl.max(score, axis=0)
    better = m > best_val
    best_idx = tl.where(better, (first_col + tl.argmax(score, axis=0)).to(tl.int32), best_idx)
    return tl.where(better, m, best_val), best_idx


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, scale_ptr, seed_ptr, val_ptr, idx_ptr, stride, V, counters_per_row,
                          cols_per_split, SPLITS, BLOCK_C: tl.constexpr, FAST_LOG: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    seed = tl.load(seed_ptr)
    scale = tl.load(scale_ptr + row)
    start = split * cols_per_split
    end = tl.minimum(start + cols_per_split, V)
    Q: tl.constexpr = BLOCK_C // 4
    offs = tl.arange(0, Q)
    logits_row = logits_ptr + row.to(tl.int64) * stride
    best_val = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int32)
    for c0 in range(start, end, BLOCK_C):
        # One Philox call gives 4 numbers: counter (row, c0 / 4 + j) feeds column c0 + s Q + j of
        # sub-block s = 0..3. Counters never repeat within a call (c0 steps by BLOCK_C, rows by
        # counters_per_row >= the padded row / 4), and the seed is fresh each call.
        counter = (row.to(tl.int64) * counters_per_row + c0 // 4 + offs).to(tl.uint32)
        u0, u1, u2, u3 = tl.rand4x(seed, counter)
        score = _gumbel_scores(logits_row, u0, c0 + offs, end, scale, FAST_LOG)
        best_val, best_idx = _best(score, c0, best_val, best_idx)
        score = _gumbel_scores(logits_row, u1, c0 + Q + offs, end, scale, FAST_LOG)
        best_val, best_idx = _best(score, c0 + Q, best_val, best_idx)
        score = _gumbel_scores(logits_row, u2, c0 + 2 * Q + offs, end, scale, FAST_LOG)
        best_val, best_idx = _best(score, c0 + 2 * Q, best_val, best_idx)
        score = _gumbel_scores(logits_row, u3, c0 + 3 * Q + offs, end, scale, FAST_LOG)
        best_val, best_idx = _best(score, c0 + 3 * Q, best_val, best_idx)
    tl.store(val_ptr + row * SPLITS + split, best_val)
    tl.store(idx_ptr + row * SPLITS + split, best_idx)


def gumbel_sample(logits: torch.Tensor, noise_scale: torch.Tensor) -> torch.Tensor:
    """Token ids [N] int64 drawn from softmax(logits / noise_scale) row by row (argmax where
    noise_scale is 0). CUDA only (the reference, gumbel_sample_ref, runs anywhere)."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"gumbel_sample takes [N, V] logits with a contiguous last dim; got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    if noise_scale.shape != (rows,):
        raise ValueError(f"noise_scale must be [{rows}]; got {tuple(noise_scale.shape)}")
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    block = max(16, min(BLOCK, next_power_of_2(vocab)))
    chunks = -(-vocab // block)
    splits = max(1, min(chunks, -(-MIN_PROGRAMS // rows)))
    cols_per_split = -(-chunks // splits) * block  # a multiple of block: the counters stay apart
    splits = -(-vocab // cols_per_split)
    seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int32, device=logits.device)
    vals = torch.empty((rows, splits), dtype=torch.float32, device=logits.device)
    idx = torch.empty((rows, splits), dtype=torch.int32, device=logits.device)
    _gumbel_argmax_kernel[(rows, splits)](
        logits, noise_scale.float().contiguous(), seed, vals, idx, logits.stride(0), vocab,
        chunks * block // 4, cols_per_split, splits, BLOCK_C=block, FAST_LOG=not INTERPRETED, num_warps=NUM_WARPS)
    if splits == 1:
        return idx[:, 0].long()
    return idx.gather(1, vals.argmax(dim=1, keepdim=True))[:, 0].long()


def gumbel_sample_ref(logits: torch.Tensor, noise_scale: torch.Tensor,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """The definition, in torch: argmax(l + T g) with g Gumbel(0, 1) from torch's RNG."""
    u = torch.rand(logits.shape, generator=generator, device=logits.device).clamp_min_(1.0e-30)
    g = -torch.log(-torch.log(u))
    return torch.argmax(logits.float() + noise_scale.float()[:, None] * g, dim=-1)
