"""What the kernel tests (and benchmarks/) share: the device they run on, the issue's tolerances,
and random paged batches. Test code only; the runtime package does not import it."""

from __future__ import annotations

import torch

from rooflm.engine.block_manager import slot_mapping
from rooflm.kernels.utils import cdiv
from rooflm.layers.attention import AttentionMetadata

# Compiled on a CUDA machine, under Triton's interpreter on the CPU (conftest.py sets it).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Tolerances of the issue: relative error ||out - ref|| / ||ref|| per input dtype.
REL_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}


def cuda_capability_at_least(capability: tuple[int, int]) -> bool:
    """For skipif conditions of gpu-marked tests: False without CUDA, so collection on the CPU
    never asks for a capability."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= capability


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64; NaN anywhere in out gives NaN (never passes a < check)."""
    out64 = out.double()
    ref64 = ref.double()
    return ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    """||out - ref|| / ||ref|| within the issue's tolerance for dtype; NaN never passes."""
    err = rel_error(out, ref)
    tol = REL_TOL[dtype]
    assert err < tol, f"{what} relative error {err:.3e} >= {tol:.0e} ({dtype})"


def random_paged_batch(seq_lens: list[int], query_lens: list[int], num_kv_heads: int, head_dim: int,
                       block_size: int, dtype: torch.dtype, device: torch.device | str,
                       spare_blocks: int = 3, poison_unused: bool = True):
    """A random packed batch over a paged cache, for tests and benchmarks.

    Sequence s has seq_lens[s] tokens of context, the last query_lens[s] of
    which are this step's queries; sequences with one query token must come
    first (the model runner's order), and they are counted as decodes. Blocks
    are handed out in a random order so block tables are not contiguous. The
    cache holds random K/V in every slot a sequence owns; with poison_unused,
    every other slot is NaN, so a kernel that reads past a sequence's end
    fails the test. Returns (meta, k_cache, v_cache).
    """
    if len(seq_lens) != len(query_lens):
        raise ValueError("seq_lens and query_lens differ in length")
    blocks_per_seq = [cdiv(n, block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks).tolist()
    max_blocks = max(blocks_per_seq)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    slots = []
    next_block = 0
    for s, (n, q) in enumerate(zip(seq_lens, query_lens)):
        if not 1 <= q <= n:
            raise ValueError(f"sequence {s}: query_len {q} must be in [1, seq_len {n}]")
        ids = perm[next_block:next_block + blocks_per_seq[s]]
        next_block += blocks_per_seq[s]
        block_tables[s, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        if poison_unused and n % block_size:
            k_cache[ids[-1], n % block_size:] = float("nan")
            v_cache[ids[-1], n % block_size:] = float("nan")
        slots += slot_mapping(ids, n - q, q, block_size)
    if poison_unused and next_block < num_blocks:
        unused = torch.tensor(perm[next_block:], device=device)
        k_cache[unused] = float("nan")
        v_cache[unused] = float("nan")
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        num_decodes=num_decodes,
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(seq_lens),
    )
    return meta, k_cache, v_cache
