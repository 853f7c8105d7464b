"""The block manager needs no device: exact block ids through every operation."""

import pytest

from rooflm.engine.block_manager import BlockManager, hash_block


def alloc(bm, table, computed, after):
    copies = []
    assert bm.allocate_slots(table, computed, after, copies)
    return copies


def test_allocate_takes_blocks_in_order_and_free_returns_tail_first():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = [], []
    alloc(bm, a, 0, 10)  # 3 blocks
    alloc(bm, b, 0, 4)  # 1 block
    assert a == [0, 1, 2] and b == [3]
    assert bm.num_free_blocks == 4
    bm.free(a)
    assert a == []
    # Free queue: untouched 4..7 first, then a's blocks tail first.
    assert list(bm.free_queue) == [4, 5, 6, 7, 2, 1, 0]


def test_append_allocates_only_at_block_boundaries():
    bm = BlockManager(num_blocks=4, block_size=4)
    t = []
    alloc(bm, t, 0, 3)
    assert t == [0]
    alloc(bm, t, 3, 4)
    assert t == [0]  # the fourth token still fits
    alloc(bm, t, 4, 5)
    assert t == [0, 1]


def test_allocation_fails_without_side_effects_when_short():
    bm = BlockManager(num_blocks=2, block_size=4)
    t = [], []
    alloc(bm, t[0], 0, 8)
    copies = []
    assert not bm.allocate_slots(t[1], 0, 1, copies)
    assert t[1] == [] and copies == [] and bm.num_free_blocks == 0


def test_prefix_hit_needs_whole_matching_prefix_and_skips_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    t = []
    alloc(bm, t, 0, 10)
    bm.cache_full_blocks(tokens, t, 10, None, 0)
    assert bm.find_cached_prefix(tokens, None) == [0, 1]
    # Same second block but a different first block: the chained hash misses entirely.
    other = [99] + tokens[1:]
    assert bm.find_cached_prefix(other, None) == []
    # Exactly 8 tokens: only one block may hit, the last token must be computed.
    assert bm.find_cached_prefix(tokens[:8], None) == [0]
    # A salt separates tenants.
    assert bm.find_cached_prefix(tokens, "tenant-b") == []


def test_cached_free_blocks_are_revived_then_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = []
    alloc(bm, a, 0, 4)  # blocks 0, 1
    bm.cache_full_blocks([1, 2, 3, 4], a, 4, None, 0)
    bm.free(a)
    assert list(bm.free_queue) == [2, 3, 1, 0]
    hits = bm.find_cached_prefix([1, 2, 3, 4, 5], None)
    assert hits == [0, 1]
    b = []
    assert bm.can_allocate(1, hits)
    bm.take_cached_prefix(b, hits)
    assert b == [0, 1] and bm.blocks[0].ref_cnt == 1 and list(bm.free_queue) == [2, 3]
    bm.free(b)  # free queue now 2, 3, 1, 0
    # New allocations take 2 and 3, then evict 1 (least recently freed cached block).
    c = []
    alloc(bm, c, 0, 6)
    assert c == [2, 3, 1]
    assert bm.blocks[1].block_hash is None
    assert bm.find_cached_prefix([1, 2, 3, 4, 5], None) == [0]


def test_fork_shares_blocks_and_copy_on_write_on_partial_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = []
    alloc(bm, parent, 0, 6)  # blocks 0 (full), 1 (2 of 4 tokens)
    child1 = bm.fork(parent)
    child2 = bm.fork(parent)
    assert bm.blocks[0].ref_cnt == 3 and bm.blocks[1].ref_cnt == 3
    # Each writer of the shared partial block gets its own copy; the last writes in place.
    assert alloc(bm, child1, 6, 7) == [(1, 2)]
    assert child1 == [0, 2]
    assert alloc(bm, child2, 6, 7) == [(1, 3)]
    assert child2 == [0, 3]
    assert alloc(bm, parent, 6, 7) == []
    assert parent == [0, 1]
    assert bm.blocks[0].ref_cnt == 3 and bm.blocks[1].ref_cnt == 1
    for t in (parent, child1, child2):
        bm.free(t)
    assert bm.num_free_blocks == 8 and all(b.ref_cnt == 0 for b in bm.blocks)


def test_full_shared_block_is_not_copied():
    bm = BlockManager(num_blocks=4, block_size=4)
    parent = []
    alloc(bm, parent, 0, 4)
    child = bm.fork(parent)
    assert alloc(bm, child, 4, 5) == []
    assert child == [0, 1]


def test_swap_out_and_in_moves_shared_blocks_once():
    bm = BlockManager(num_blocks=4, block_size=4, num_host_blocks=4)
    a = []
    alloc(bm, a, 0, 8)
    b = bm.fork(a)
    pairs = bm.swap_out([a, b])
    assert pairs == [(0, 0), (1, 1)]
    assert a == b == [0, 1] and bm.num_free_blocks == 4 and len(bm.free_host_blocks) == 2
    back = bm.swap_in([a, b])
    assert [h for h, _ in back] == [0, 1]
    assert a == b and bm.blocks[a[0]].ref_cnt == 2
    assert len(bm.free_host_blocks) == 4


def test_hash_chains_parent():
    h1 = hash_block(None, [1, 2], None)
    assert hash_block(h1, [3, 4], None) != hash_block(None, [3, 4], None)
    assert hash_block(None, [1, 2], "s") != h1


def test_rejects_empty_pool():
    with pytest.raises(ValueError, match="at least one block"):
        BlockManager(0, 16)
