"""moe_align_block_size: a batch's (token, k) pairs sorted by expert and padded into BLOCK_M-row
blocks, so that one grouped GEMM can give every block of rows a single expert's weights.

Why
---
A mixture-of-experts layer routes token t to top_k experts: T * top_k (token, k) pairs, each
needing its expert's MLP. The fused MoE kernel (fused_moe.py) runs one launch over all experts:
each program owns BLOCK_M rows of one expert. So the pairs are listed expert by expert, each
expert's list padded to a multiple of BLOCK_M with a sentinel id, and each block of rows is told
its expert. An expert without tokens gets no block: its weights are never read.

Output (vLLM's and SGLang's names)
------
  sorted_token_ids  int32 [max_padded]: pair ids (pair p = token p // top_k, its k = p % top_k)
                    expert by expert; padding slots and the unused tail hold T * top_k
  expert_ids        int32 [max_padded / BLOCK_M]: the expert of each block; -1 past the last block
  num_tokens_post_padded  int32 [1]: rows in use (a multiple of BLOCK_M), read by the kernel on the
                    device, so nothing here waits for the host and a CUDA graph can capture it

max_padded = N + min(E, N) * (BLOCK_M - 1), N = T * top_k, rounded up to BLOCK_M: at most
min(E, N) experts have tokens, and each wastes at most BLOCK_M - 1 padding rows. The arrays'
sizes depend only on T, top_k, E and BLOCK_M, never on the routing (CUDA graphs replay them).

Algorithm (torch, sync-free)
---------
  counts  = scatter_add of ones at each pair's expert               [E]
  padded  = ceil(counts / BLOCK_M) * BLOCK_M; its cumsum: each expert's padded row range
  order   = stable argsort of the pairs' experts: the pairs expert by expert, in pair order
  a pair's row = its expert's padded start + its rank among the expert's pairs
  a block's expert = the first expert whose padded range ends past the block's first row

Two implementations, the same arrays id for id:
  moe_align_block_size         torch, about a dozen small launches (scatter_add, two cumsums,
                               argsort, a scatter, searchsorted): the CPU path and the reference
  moe_align_block_size_triton  one Triton launch of one program (CUDA; the interpreter on CPU)
At decode, 48 layers x a dozen launches were ~0.6k launches a step of a few microseconds each
(the H200 profile of Qwen3-30B-A3B: idle gaps 1.66 ms of a 7.82 ms step); the bytes are
O(T * top_k + E), nothing next to the expert weights, so the launch count is the cost.

The one-program kernel (no inter-program sync, so no second launch and no atomics):
  pass 1  over the pairs in chunks of CHUNK: counts[e] += sum over the chunk of [id == e]
          (a [CHUNK, E_PAD] one-hot compare; E <= 1024)
          padded_end = cumsum(ceil(counts / BLOCK_M) * BLOCK_M), padded_start = padded_end - padded
  pass 2  over the pairs again: a pair's row = padded_start[e] + (pairs of e in earlier chunks)
          + (pairs of e before it in this chunk: the one-hot's exclusive cumsum down the chunk),
          so pairs keep their order within an expert, as the stable argsort does
  pass 3  over the rows: a row no pair lands on (its expert's padding, or past the last block)
          gets the sentinel; the rows of pass 2 and of pass 3 are disjoint, so no barrier orders
          the stores
  pass 4  over the blocks: the expert whose padded range holds the block's first row, else -1
Work: O((T * top_k + max_padded) * E_PAD) compares on one SM: ~1 us at decode (8 pairs);
at T = 1024, top_k = 8, E = 128 ~ 2.6M compares, tens of microseconds, still small beside
that batch's grouped GEMMs (benchmarks/moe_kernel.py prints both aligns).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class AlignedPairs(NamedTuple):
    sorted_token_ids: torch.Tensor  # int32 [max_padded]
    expert_ids: torch.Tensor  # int32 [max_padded // block_m]
    num_tokens_post_padded: torch.Tensor  # int32 [1]


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows the sorted arrays hold: every pair plus the worst-case padding, in whole blocks."""
    worst = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-worst // block_m) * block_m


def _check(topk_ids: torch.Tensor, block_m: int, num_experts: int) -> None:
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, top_k], got {tuple(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point:
        raise TypeError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if block_m < 1 or num_experts < 1:
        raise ValueError(f"block_m ({block_m}) and num_experts ({num_experts}) must be positive")


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int) -> AlignedPairs:
    """Sort topk_ids' (token, k) pairs by expert into BLOCK_M-row blocks (module docstring).

    topk_ids [T, top_k] integer expert ids in [0, num_experts), or -1 for a pair no expert here
    takes (expert parallelism: another rank's expert), which is sorted nowhere. Ids are not
    checked here (that would wait for the device): one outside the range is the router's bug."""
    _check(topk_ids, block_m, num_experts)
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    size = max_padded_rows(num_pairs, num_experts, block_m)
    # -1 pairs count in an extra bucket E with no padded rows: they sort last and land in a dump
    # row past the end (no host sync, so a CUDA graph captures it). Ids past E go there too: a
    # router fed NaNs (a piecewise capture's unwritten attention output) must not trip the
    # scatter's device-side bounds assert, which kills the process; the Triton align skips them.
    flat = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)

    counts_all = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts_all.scatter_add_(0, flat, torch.ones_like(flat))
    counts = counts_all[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = torch.cat([padded_end - padded, padded_end.new_full((1,), size)])
    count_start = torch.cumsum(counts_all, 0) - counts_all

    order = torch.argsort(flat, stable=True)
    expert_of_sorted = flat[order]
    rank = torch.arange(num_pairs, device=device) - count_start[expert_of_sorted]
    rows = torch.where(expert_of_sorted < num_experts, padded_start[expert_of_sorted] + rank, size)
    sorted_token_ids = torch.full((size + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_token_ids[rows] = order.to(torch.int32)
    sorted_token_ids = sorted_token_ids[:size]

    block_first_row = torch.arange(0, size, block_m, device=device)
    expert_ids = torch.searchsorted(padded_end, block_first_row, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    num_tokens_post_padded = padded_end[-1:].to(torch.int32)
    return AlignedPairs(sorted_token_ids, expert_ids, num_tokens_post_padded)


# --------------------------------------------------------------------------
# One-launch Triton kernel
# --------------------------------------------------------------------------

@triton.jit
def _moe_align_kernel(topk_ids_ptr, sorted_ptr, expert_ids_ptr, post_padded_ptr,
                      num_pairs, num_experts, size, num_blocks,
                      BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    experts = tl.arange(0, E_PAD)
    chunk = tl.arange(0, CHUNK)

    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        pairs = start + chunk
        ids = tl.load(topk_ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32)
        ids = tl.where(ids < num_experts, ids, -1)  # an id past E (a router fed NaNs) is no expert's
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded
    tl.store(post_padded_ptr, tl.sum(padded, axis=0))

    seen = tl.zeros([E_PAD], dtype=tl.int32)  # pairs of each expert placed by earlier chunks
    for start in range(0, num_pairs, CHUNK):
        pairs = start + chunk
        valid = pairs < num_pairs
        ids = tl.load(topk_ids_ptr + pairs, mask=valid, other=-1).to(tl.int32)
        ids = tl.where(ids < num_experts, ids, -1)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        before = tl.cumsum(onehot, axis=0) - onehot  # same-expert pairs ahead in this chunk
        rows = tl.sum(onehot * (padded_start + seen)[None, :] + onehot * before, axis=1)
        # a -1 pair (another rank's expert, expert parallelism) matches no lane: stored nowhere
        tl.store(sorted_ptr + rows, pairs, mask=valid & (ids >= 0))
        seen += tl.sum(onehot, axis=0)

    filled_end = padded_start + counts
    total = tl.sum(padded, axis=0)
    for start in range(0, size, CHUNK):
        rows = start + chunk
        in_padding = ((rows[:, None] >= filled_end[None, :]) & (rows[:, None] < padded_end[None, :])).to(tl.int32)
        sentinel = (tl.sum(in_padding, axis=1) > 0) | (rows >= total)
        tl.store(sorted_ptr + rows, tl.zeros([CHUNK], dtype=tl.int32) + num_pairs, mask=(rows < size) & sentinel)

    for start in range(0, num_blocks, CHUNK):
        blocks = start + chunk
        first = blocks * BLOCK_M
        owns = (first[:, None] >= padded_start[None, :]) & (first[:, None] < padded_end[None, :])
        owner = tl.sum(tl.where(owns, experts[None, :], 0), axis=1)
        has_owner = tl.sum(owns.to(tl.int32), axis=1) > 0
        tl.store(expert_ids_ptr + blocks, tl.where(has_owner, owner, -1), mask=blocks < num_blocks)


MAX_EXPERTS_ONE_PROGRAM = 1024  # E_PAD lanes held in registers by the one program


def moe_align_block_size_triton(topk_ids: torch.Tensor, block_m: int, num_experts: int) -> AlignedPairs:
    """moe_align_block_size in one Triton launch (module docstring): the same arrays, id for id,
    fixed-size outputs and nothing read back on the host, so a CUDA graph captures it."""
    _check(topk_ids, block_m, num_experts)
    if num_experts > MAX_EXPERTS_ONE_PROGRAM:
        raise ValueError(f"moe_align_block_size_triton holds the experts in one program: "
                         f"{num_experts} > {MAX_EXPERTS_ONE_PROGRAM}; use moe_align_block_size")
    device = topk_ids.device
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    num_pairs = flat.numel()
    size = max_padded_rows(num_pairs, num_experts, block_m)
    sorted_token_ids = torch.empty(size, dtype=torch.int32, device=device)
    expert_ids = torch.empty(size // block_m, dtype=torch.int32, device=device)
    num_tokens_post_padded = torch.empty(1, dtype=torch.int32, device=device)
    e_pad = max(16, triton.next_power_of_2(num_experts))
    chunk = max(16, min(128, 8192 // e_pad))  # a [CHUNK, E_PAD] one-hot of <= 8K lanes
    _moe_align_kernel[(1,)](flat, sorted_token_ids, expert_ids, num_tokens_post_padded,
                            num_pairs, num_experts, size, size // block_m,
                            BLOCK_M=block_m, E_PAD=e_pad, CHUNK=chunk, num_warps=4 if e_pad <= 128 else 8)
    return AlignedPairs(sorted_token_ids, expert_ids, num_tokens_post_padded)


def moe_align_block_size_ref(topk_ids: torch.Tensor, block_m: int, num_experts: int) -> AlignedPairs:
    """The same lists built one pair at a time in Python: the definition the tests check against."""
    pairs = topk_ids.reshape(-1).tolist()
    num_pairs = len(pairs)
    size = max_padded_rows(num_pairs, num_experts, block_m)
    ids: list[int] = []
    experts: list[int] = []
    for e in range(num_experts):
        mine = [p for p, expert in enumerate(pairs) if expert == e]
        if not mine:
            continue
        blocks = -(-len(mine) // block_m)
        ids += mine + [num_pairs] * (blocks * block_m - len(mine))
        experts += [e] * blocks
    used = len(ids)
    ids += [num_pairs] * (size - used)
    experts += [-1] * (size // block_m - len(experts))
    return AlignedPairs(torch.tensor(ids, dtype=torch.int32), torch.tensor(experts, dtype=torch.int32),
                        torch.tensor([used], dtype=torch.int32))
