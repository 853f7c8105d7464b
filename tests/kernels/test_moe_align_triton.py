"""The one-launch Triton moe_align_block_size (rooflm/kernels/moe_align.py) against the torch one
and the one-pair-at-a-time definition, array for array, id for id."""

import pytest
import torch

from tests.kernels.helpers import DEVICE
from rooflm.kernels.moe_align import (max_padded_rows, moe_align_block_size, moe_align_block_size_ref,
                                      moe_align_block_size_triton)


def _routing(num_tokens, num_experts, top_k, gen, pool=None):
    pool = pool or num_experts
    return torch.stack([torch.randperm(pool, generator=gen)[:top_k] for _ in range(num_tokens)])


def _assert_same(got, want):
    for name, g, w in zip(got._fields, got, want):
        assert g.dtype == torch.int32, name
        assert g.shape == w.shape, f"{name}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        assert torch.equal(g.cpu(), w.cpu()), f"{name}: {g.tolist()} != {w.tolist()}"


@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m,pool", [
    (1, 8, 2, 16, None),      # decode: two experts, each one block of mostly padding
    (5, 4, 2, 4, None),
    (20, 8, 2, 16, 3),        # uneven: everything on three experts, five empty
    (13, 6, 3, 4, None),
    (9, 16, 1, 8, None),
    (7, 5, 5, 2, None),       # top_k = E: every expert, every token
    (40, 3, 2, 4, None),      # pairs span several chunks of the kernel
    (3, 200, 8, 16, 40),      # E not a power of two, most experts empty
])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_triton_align_equals_the_reference(num_tokens, num_experts, top_k, block_m, pool, dtype):
    gen = torch.Generator().manual_seed(num_tokens * 31 + num_experts)
    ids = _routing(num_tokens, num_experts, top_k, gen, pool).to(dtype)
    got = moe_align_block_size_triton(ids.to(DEVICE), block_m, num_experts)
    _assert_same(got, moe_align_block_size_ref(ids, block_m, num_experts))
    _assert_same(got, moe_align_block_size(ids, block_m, num_experts))


def test_triton_align_one_crowded_expert_and_empty_ones():
    ids = torch.tensor([[3], [3], [3], [3], [3], [1]], dtype=torch.int32, device=DEVICE)
    got = moe_align_block_size_triton(ids, block_m=2, num_experts=4)
    assert got.sorted_token_ids.tolist()[:8] == [5, 6, 0, 1, 2, 3, 4, 6]
    assert got.sorted_token_ids.numel() == max_padded_rows(6, 4, 2)
    assert set(got.sorted_token_ids.tolist()[8:]) == {6}
    assert got.expert_ids.tolist() == [1, 3, 3, 3, -1]
    assert got.num_tokens_post_padded.tolist() == [8]


def test_triton_align_writes_every_slot(monkeypatch):
    """Outputs come from torch.empty (a CUDA graph replays into the same stale buffers): the
    kernel must write every slot. Poisoned allocations show any slot it skipped."""
    real_empty = torch.empty
    calls = []

    def poisoned(*shape, dtype=None, device=None, **kw):
        calls.append(shape)
        return real_empty(*shape, dtype=dtype, device=device, **kw).fill_(-7)

    gen = torch.Generator().manual_seed(5)
    for pool in (8, 1):
        ids = _routing(6, 8, 1, gen, pool)
        monkeypatch.setattr(torch, "empty", poisoned)
        got = moe_align_block_size_triton(ids.to(DEVICE), 4, 8)
        monkeypatch.setattr(torch, "empty", real_empty)
        _assert_same(got, moe_align_block_size_ref(ids, 4, 8))
    assert len(calls) == 6  # three outputs a call: all of them came poisoned


def test_triton_align_rejects_bad_inputs():
    with pytest.raises(ValueError, match="topk_ids must be"):
        moe_align_block_size_triton(torch.zeros(4, dtype=torch.int64), 16, 4)
    with pytest.raises(ValueError, match="one program"):
        moe_align_block_size_triton(torch.zeros(1, 1, dtype=torch.int64), 16, 4096)


@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m", [(1, 8, 2, 16), (9, 6, 3, 4), (40, 4, 2, 2)])
def test_pairs_of_another_ranks_experts_are_sorted_nowhere(num_tokens, num_experts, top_k, block_m):
    """-1 ids (expert parallelism: experts held by another rank) take no row and no block, in the
    torch align, the Triton one and the definition alike."""
    gen = torch.Generator().manual_seed(num_tokens + num_experts)
    ids = _routing(num_tokens, 2 * num_experts, top_k, gen)
    ids = torch.where(ids < num_experts, ids, torch.full_like(ids, -1)).to(torch.int32)  # half the experts elsewhere
    assert (ids == -1).any()
    want = moe_align_block_size_ref(ids, block_m, num_experts)
    _assert_same(moe_align_block_size(ids, block_m, num_experts), want)
    _assert_same(moe_align_block_size_triton(ids.to(DEVICE), block_m, num_experts), want)
    local_pairs = (ids.reshape(-1) >= 0).nonzero().reshape(-1).tolist()
    placed = [p for p in want.sorted_token_ids.tolist() if p < ids.numel()]
    assert sorted(placed) == local_pairs


def test_ids_past_the_experts_are_sorted_nowhere_too():
    """A router fed NaNs (the piecewise capture's unwritten attention output) may hand out ids past
    E: both aligns skip them like -1 (no scatter bounds assert on CUDA, no block of a missing expert)."""
    ids = torch.tensor([[0, 7], [9, 1], [2, -1]], dtype=torch.int64)
    want = moe_align_block_size_ref(ids, 2, 4)
    _assert_same(moe_align_block_size(ids, 2, 4), want)
    _assert_same(moe_align_block_size_triton(ids.to(DEVICE), 2, 4), want)
    assert sorted(p for p in want.sorted_token_ids.tolist() if p < 6) == [0, 3, 4]
