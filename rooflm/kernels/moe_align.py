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

Cost: about a dozen small launches (scatter_add, two cumsums, argsort, a scatter, searchsorted),
a few microseconds each in eager mode and well under that inside a CUDA graph; the bytes are
O(T * top_k + E), nothing next to the expert weights. A single Triton kernel (vLLM's CUDA
moe_align_block_size is one launch) is the next step if a decode profile shows these launches.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class AlignedPairs(NamedTuple):
    sorted_token_ids: torch.Tensor  # int32 [max_padded]
    expert_ids: torch.Tensor  # int32 [max_padded // block_m]
    num_tokens_post_padded: torch.Tensor  # int32 [1]


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows the sorted arrays hold: every pair plus the worst-case padding, in whole blocks."""
    worst = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-worst // block_m) * block_m


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int) -> AlignedPairs:
    """Sort topk_ids' (token, k) pairs by expert into BLOCK_M-row blocks (module docstring).

    topk_ids [T, top_k] integer expert ids in [0, num_experts); not checked here (that would
    wait for the device): an id outside the range is the router's bug."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, top_k], got {tuple(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point:
        raise TypeError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if block_m < 1 or num_experts < 1:
        raise ValueError(f"block_m ({block_m}) and num_experts ({num_experts}) must be positive")
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    size = max_padded_rows(num_pairs, num_experts, block_m)

    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts

    order = torch.argsort(flat, stable=True)
    expert_of_sorted = flat[order]
    rank = torch.arange(num_pairs, device=device) - count_start[expert_of_sorted]
    rows = padded_start[expert_of_sorted] + rank
    sorted_token_ids = torch.full((size,), num_pairs, dtype=torch.int32, device=device)
    sorted_token_ids[rows] = order.to(torch.int32)

    block_first_row = torch.arange(0, size, block_m, device=device)
    expert_ids = torch.searchsorted(padded_end, block_first_row, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    num_tokens_post_padded = padded_end[-1:].to(torch.int32)
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
