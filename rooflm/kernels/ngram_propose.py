"""Prompt-lookup (n-gram) drafts on the device, for speculative decoding's device loop.

Why
---
The device loop (rooflm/spec/loop.py) keeps each sequence's tokens on the GPU and launches the
next verify step before the host has read the last one's tokens, so its drafts must be found
there too: this kernel is the host proposer's lookup (rooflm/spec/ngram.py) over a device
history buffer.

Algorithm
---------
For n = N_MAX down to N_MIN, the last n tokens of a sequence's history are looked for earlier in
it: windows tokens[i : i + n] with i <= length - 1 - n (a window never covers the last token,
so the suffix cannot find itself). At the latest matching i the drafts are the tokens from
i + n on, at most K, fewer where they run into the history's end. The longest n with a match
wins. One program per sequence scans its history in BLOCK-token tiles once per n, from the end
backwards, and stops at the first tile that matches (its largest matching i); once an n has
matched, the shorter ones scan nothing.

Shapes
------
hist [B, L] int32 (token ids; row b holds lengths[b] of them), lengths [B] int64 (0: an empty
slot, no drafts); out: drafts [B, K] int64 (0 past the count), num_drafts [B] int64.

Work
----
No FLOPs to speak of: at most (N_MAX - N_MIN + 1) scans of length tokens, each re-reading the
tile n times from L1; a match near the end stops a scan after one tile. One launch per step. A
history with no match at all costs a full scan per n by one program per sequence. H100
(benchmarks/ngram_scan.py, 2026-11-26): ~6 us with repeats at any length; with none, 7 us at 1k
tokens, 44 us at 16k, 456 us at 128k (7% of a batch-1 verify step; batch 16 the same).

Reference: ngram_propose_ref (the same scan in numpy); tests/kernels/test_ngram_propose.py.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from rooflm.kernels.utils import next_power_of_2


@triton.jit
def _latest_window(row, length, hi, n: tl.constexpr, BLOCK: tl.constexpr):
    """The largest window start i < hi whose n tokens equal the last n tokens, or -1. Tiles go
    from the end backwards and stop at the first that matches: repetitive text matches near its
    end, so a long history is scanned whole only when nothing matches."""
    offs = tl.arange(0, BLOCK)
    best = length * 0 - 1
    i0 = hi - BLOCK
    while (best < 0) & (i0 + BLOCK > 0):
        i = i0 + offs
        hit = (i >= 0) & (i < hi)
        for j in tl.static_range(n):
            suffix_j = tl.load(row + length - n + j)
            hit &= tl.load(row + i + j, mask=hit, other=-1) == suffix_j
        best = tl.max(tl.where(hit, i, -1), 0)
        i0 -= BLOCK
    return best


@triton.jit
def _ngram_propose_kernel(hist_ptr, lengths_ptr, drafts_ptr, num_drafts_ptr, stride_h, stride_d,
                          K: tl.constexpr, K_PAD: tl.constexpr, N_MAX: tl.constexpr,
                          N_MIN: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    length = tl.load(lengths_ptr + b).to(tl.int32)
    row = hist_ptr + b.to(tl.int64) * stride_h
    start = length * 0 - 1  # where the drafts begin; -1: no match yet
    for t in tl.static_range(N_MAX - N_MIN + 1):
        # Windows i <= length - 1 - n never cover the last token; an n that matched ends the search.
        hi = tl.where(start < 0, length - (N_MAX - t), 0)
        best = _latest_window(row, length, hi, N_MAX - t, BLOCK)
        start = tl.where((start < 0) & (best >= 0), best + (N_MAX - t), start)
    count = tl.where(start >= 0, tl.minimum(length - start, K), 0)
    offs_k = tl.arange(0, K_PAD)
    take = offs_k < count
    drafts = tl.load(row + tl.maximum(start, 0) + offs_k, mask=take, other=0)
    tl.store(drafts_ptr + b.to(tl.int64) * stride_d + offs_k, drafts.to(tl.int64), mask=offs_k < K)
    tl.store(num_drafts_ptr + b, count.to(tl.int64))


def ngram_propose(hist: torch.Tensor, lengths: torch.Tensor, drafts: torch.Tensor,
                  num_drafts: torch.Tensor, n_max: int, n_min: int, batch: int | None = None,
                  block: int = 1024) -> None:
    """Fill drafts[:batch] and num_drafts[:batch] from the histories hist[:batch] (see the
    module docstring). No host synchronisation: capturable, and it queues behind the step
    that wrote the histories."""
    batch = hist.shape[0] if batch is None else batch
    if batch == 0:
        return
    k = drafts.shape[1]
    if hist.dtype != torch.int32 or lengths.dtype != torch.int64:
        raise TypeError(f"hist must be int32 and lengths int64, got {hist.dtype} and {lengths.dtype}")
    if drafts.dtype != torch.int64 or num_drafts.dtype != torch.int64:
        raise TypeError("drafts and num_drafts must be int64")
    if hist.stride(1) != 1 or drafts.stride(1) != 1:
        raise ValueError("hist and drafts need contiguous rows")
    _ngram_propose_kernel[(batch,)](
        hist, lengths, drafts, num_drafts, hist.stride(0), drafts.stride(0),
        K=k, K_PAD=next_power_of_2(max(k, 2)), N_MAX=n_max, N_MIN=n_min, BLOCK=block, num_warps=4)


def ngram_propose_ref(hist: torch.Tensor, lengths: torch.Tensor, drafts: torch.Tensor,
                      num_drafts: torch.Tensor, n_max: int, n_min: int, batch: int | None = None) -> None:
    """The scan the kernel does, row by row in numpy (the host proposer's lookup, spec/ngram.py,
    finds the same drafts; the tests check both)."""
    batch = hist.shape[0] if batch is None else batch
    k = drafts.shape[1]
    rows = hist[:batch].cpu().numpy()
    for b, length in enumerate(lengths[:batch].tolist()):
        tokens, found = rows[b, :length], []
        for n in range(min(n_max, length - 1), n_min - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                found = tokens[start:start + k].tolist()
                break
        drafts[b] = torch.tensor(found + [0] * (k - len(found)), dtype=torch.int64)
        num_drafts[b] = len(found)
