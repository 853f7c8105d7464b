"""The block manager needs no device: exact block ids through every operation."""

import pytest

from rooflm.engine.block_manager import NO_HIT, BlockManager, BlockTable, PrefixHit, hash_block, slot_mapping


def alloc(bm, table, computed, after):
    copies = []
    assert bm.allocate(table, computed, after, copies)
    return copies


def test_allocate_takes_blocks_in_order_and_free_returns_tail_first():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = bm.new_table(), bm.new_table()
    alloc(bm, a, 0, 10)  # 3 blocks
    alloc(bm, b, 0, 4)  # 1 block
    assert a.ids == [0, 1, 2] and b.ids == [3]
    assert bm.num_free_blocks == 4
    bm.free(a)
    assert a.ids == [] and len(a) == 0
    # Free queue: untouched 4..7 first, then a's blocks tail first.
    assert list(bm.free_queue) == [4, 5, 6, 7, 2, 1, 0]


def test_append_allocates_only_at_block_boundaries():
    bm = BlockManager(num_blocks=4, block_size=4)
    t = bm.new_table()
    alloc(bm, t, 0, 3)
    assert t.ids == [0]
    alloc(bm, t, 3, 4)
    assert t.ids == [0]  # the fourth token still fits
    alloc(bm, t, 4, 5)
    assert t.ids == [0, 1]


def test_allocation_fails_without_side_effects_when_short():
    bm = BlockManager(num_blocks=2, block_size=4)
    t = bm.new_table(), bm.new_table()
    alloc(bm, t[0], 0, 8)
    copies = []
    assert not bm.allocate(t[1], 0, 1, copies)
    assert t[1].ids == [] and copies == [] and bm.num_free_blocks == 0


# ---- slot mapping --------------------------------------------------------------------------


def test_slots_follow_the_block_table():
    table = BlockTable(4, [7, 2, 5])
    # Position p is offset p % 4 of block ids[p // 4].
    assert table.slots(0, 4) == [28, 29, 30, 31]
    assert table.slots(3, 3) == [31, 8, 9]  # across a block boundary
    assert table.slots(9, 1) == [21]  # a decode token
    assert table.slots(0, 12) == [28, 29, 30, 31, 8, 9, 10, 11, 20, 21, 22, 23]
    assert table.slots(5, 0) == []


def test_slot_mapping_matches_the_formula():
    ids, bs = [3, 0, 9, 4, 1], 8
    for start in range(0, 40):
        for n in range(0, 40 - start + 1):
            expected = [ids[p // bs] * bs + p % bs for p in range(start, start + n)]
            assert slot_mapping(ids, start, n, bs) == expected


def test_table_reads_like_a_list_of_block_ids():
    bm = BlockManager(num_blocks=8, block_size=2)
    t = bm.new_table()
    assert not t and len(t) == 0
    alloc(bm, t, 0, 5)
    assert t and len(t) == 3 and list(t) == [0, 1, 2] and t[1] == 1 and t[-1] == 2
    assert t.block_size == 2 and not t.on_host


# ---- the growth rule -------------------------------------------------------------------------


def test_blocks_to_grow_counts_new_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    t = bm.new_table()
    assert bm.blocks_to_grow(t, 0, 1) == 1
    assert bm.blocks_to_grow(t, 0, 9) == 3
    alloc(bm, t, 0, 6)  # 2 blocks: 6 of 8 slots used
    assert bm.blocks_to_grow(t, 6, 8) == 0
    assert bm.blocks_to_grow(t, 6, 9) == 1
    assert bm.blocks_to_grow(t, 6, 6) == 0


def test_blocks_to_grow_counts_a_prefix_hit_as_held():
    bm = BlockManager(num_blocks=8, block_size=4)
    hit = PrefixHit((5, 6), 8)
    t = bm.new_table()
    assert bm.blocks_to_grow(t, 8, 10, hit) == 1  # blocks 5 and 6 hold tokens 0..7
    assert bm.blocks_to_grow(t, 8, 8 + 9, hit) == 3
    assert bm.blocks_to_grow(t, 8, 8, hit) == 0


def test_blocks_to_grow_counts_copy_on_write_after_a_fork():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = bm.new_table()
    alloc(bm, parent, 0, 6)  # block 1 holds 2 of 4 tokens
    child = bm.fork(parent)
    # The next token lands in shared block 1: it is copied first. No new block otherwise.
    assert bm.blocks_to_grow(child, 6, 7) == 1
    assert bm.blocks_to_grow(child, 6, 9) == 2  # the copy, and one new block
    assert alloc(bm, child, 6, 7) == [(1, 2)]
    # Now the parent is the last holder: it writes in place.
    assert bm.blocks_to_grow(parent, 6, 7) == 0


def test_blocks_to_grow_counts_copy_on_write_of_a_swapped_out_fork():
    bm = BlockManager(num_blocks=4, block_size=4, num_host_blocks=4)
    a = bm.new_table()
    alloc(bm, a, 0, 6)  # blocks 0 (full), 1 (half)
    b = bm.fork(a)
    bm.swap_out([a, b])
    assert a.on_host and b.on_host and a.ids == b.ids == [0, 1]
    # Sharing survives the swap: the half-full block is still copied before it is written.
    assert bm.blocks_to_admit([a, b]) == 2
    assert bm.blocks_to_grow(a, 6, 7) == 1 and bm.blocks_to_grow(b, 6, 7) == 1
    bm.swap_in([a, b])
    assert a.ids == b.ids == [2, 3] and bm.blocks[3].ref_cnt == 2
    assert bm.blocks_to_grow(a, 6, 7) == 1
    assert alloc(bm, a, 6, 7) == [(3, 0)]
    assert bm.blocks_to_grow(b, 6, 7) == 0


def test_blocks_to_admit_counts_host_blocks_and_revived_hits_once():
    bm = BlockManager(num_blocks=8, block_size=2, num_host_blocks=4)
    a = bm.new_table()
    alloc(bm, a, 0, 4)
    assert bm.blocks_to_admit([a]) == 0  # running: nothing to take back
    bm.cache_full_blocks(a, [1, 2, 3, 4], 4, None)
    bm.free(a)
    hit = bm.find_cached_prefix([1, 2, 3, 4, 5], None)
    assert hit == PrefixHit((0, 1), 4)
    # Two samples of a recomputed request may hit the same free blocks: taken once.
    assert bm.blocks_to_admit([bm.new_table(), bm.new_table()], [hit, hit]) == 2
    held = bm.new_table()
    bm.take_cached_prefix(held, hit)
    assert bm.blocks_to_admit([bm.new_table()], [hit]) == 0  # held by another table: not free


# ---- prefix cache ---------------------------------------------------------------------------


def test_prefix_hit_needs_whole_matching_prefix_and_skips_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    t = bm.new_table()
    alloc(bm, t, 0, 10)
    bm.cache_full_blocks(t, tokens, 10, None)
    assert t.num_cached_blocks == 2
    assert bm.find_cached_prefix(tokens, None) == PrefixHit((0, 1), 8)
    # Same second block but a different first block: the chained hash misses entirely.
    other = [99] + tokens[1:]
    assert bm.find_cached_prefix(other, None) is NO_HIT
    # Exactly 8 tokens: only one block may hit, the last token must be computed.
    assert bm.find_cached_prefix(tokens[:8], None) == PrefixHit((0,), 4)
    # A salt separates tenants.
    assert bm.find_cached_prefix(tokens, "tenant-b").num_tokens == 0


def test_cache_full_blocks_hashes_each_block_once_and_only_known_tokens():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(12))
    t = bm.new_table()
    alloc(bm, t, 0, 12)
    bm.cache_full_blocks(t, tokens, 7, None)  # only block 0 is full among 7 known tokens
    assert t.num_cached_blocks == 1 and bm.blocks[1].block_hash is None
    first = bm.blocks[0].block_hash
    bm.cache_full_blocks(t, tokens, 12, None)
    assert t.num_cached_blocks == 3 and bm.blocks[0].block_hash == first
    assert bm.blocks[1].block_hash == hash_block(first, tokens[4:8], None)


def test_prefix_hit_is_counted_as_cached_blocks_of_the_table():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = bm.new_table()
    alloc(bm, a, 0, 4)
    bm.cache_full_blocks(a, [1, 2, 3, 4], 4, None)
    hit = bm.find_cached_prefix([1, 2, 3, 4, 5, 6, 7], None)
    b = bm.new_table()
    bm.take_cached_prefix(b, hit)
    assert b.ids == [0, 1] and b.num_cached_blocks == 2
    alloc(bm, b, 4, 7)
    bm.cache_full_blocks(b, [1, 2, 3, 4, 5, 6, 7], 7, None)
    # The new full block chains from the hit's last hash.
    assert bm.blocks[b[2]].block_hash == hash_block(bm.blocks[1].block_hash, [5, 6], None)


def test_cached_free_blocks_are_revived_then_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = bm.new_table()
    alloc(bm, a, 0, 4)  # blocks 0, 1
    bm.cache_full_blocks(a, [1, 2, 3, 4], 4, None)
    bm.free(a)
    assert list(bm.free_queue) == [2, 3, 1, 0]
    hit = bm.find_cached_prefix([1, 2, 3, 4, 5], None)
    assert hit.block_ids == (0, 1) and hit.num_tokens == 4
    b = bm.new_table()
    assert bm.blocks_to_admit([b], [hit]) + bm.blocks_to_grow(b, 4, 5, hit) == 3
    bm.take_cached_prefix(b, hit)
    assert b.ids == [0, 1] and bm.blocks[0].ref_cnt == 1 and list(bm.free_queue) == [2, 3]
    bm.free(b)  # free queue now 2, 3, 1, 0
    # New allocations take 2 and 3, then evict 1 (least recently freed cached block).
    c = bm.new_table()
    alloc(bm, c, 0, 6)
    assert c.ids == [2, 3, 1]
    assert bm.blocks[1].block_hash is None
    assert bm.find_cached_prefix([1, 2, 3, 4, 5], None) == PrefixHit((0,), 2)


# ---- sharing ----------------------------------------------------------------------------------


def test_fork_shares_blocks_and_copy_on_write_on_partial_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = bm.new_table()
    alloc(bm, parent, 0, 6)  # blocks 0 (full), 1 (2 of 4 tokens)
    child1 = bm.fork(parent)
    child2 = bm.fork(parent)
    assert child1 is not parent and child1.ids is not parent.ids
    assert bm.blocks[0].ref_cnt == 3 and bm.blocks[1].ref_cnt == 3
    # Each writer of the shared partial block gets its own copy; the last writes in place.
    assert alloc(bm, child1, 6, 7) == [(1, 2)]
    assert child1.ids == [0, 2]
    assert alloc(bm, child2, 6, 7) == [(1, 3)]
    assert child2.ids == [0, 3]
    assert alloc(bm, parent, 6, 7) == []
    assert parent.ids == [0, 1]
    assert bm.blocks[0].ref_cnt == 3 and bm.blocks[1].ref_cnt == 1
    for t in (parent, child1, child2):
        bm.free(t)
    assert bm.num_free_blocks == 8 and all(b.ref_cnt == 0 for b in bm.blocks)


def test_fork_keeps_the_cached_block_count():
    bm = BlockManager(num_blocks=8, block_size=2)
    parent = bm.new_table()
    alloc(bm, parent, 0, 5)
    bm.cache_full_blocks(parent, [1, 2, 3, 4, 5], 5, None)
    assert bm.fork(parent).num_cached_blocks == 2


def test_full_shared_block_is_not_copied():
    bm = BlockManager(num_blocks=4, block_size=4)
    parent = bm.new_table()
    alloc(bm, parent, 0, 4)
    child = bm.fork(parent)
    assert alloc(bm, child, 4, 5) == []
    assert child.ids == [0, 1]


# ---- swap ------------------------------------------------------------------------------------


def test_swap_out_and_in_moves_shared_blocks_once():
    bm = BlockManager(num_blocks=4, block_size=4, num_host_blocks=4)
    a = bm.new_table()
    alloc(bm, a, 0, 8)
    b = bm.fork(a)
    assert bm.can_swap_out([a, b])
    pairs = bm.swap_out([a, b])
    assert pairs == [(0, 0), (1, 1)]
    assert a.ids == b.ids == [0, 1] and a.on_host and bm.num_free_blocks == 4
    assert len(bm.free_host_blocks) == 2 and bm.host_ref_cnt[:2] == [2, 2]
    back = bm.swap_in([a, b])
    assert [h for h, _ in back] == [0, 1]
    assert a.ids == b.ids and not a.on_host and bm.blocks[a[0]].ref_cnt == 2
    assert len(bm.free_host_blocks) == 4 and bm.host_ref_cnt == [0, 0, 0, 0]


def test_swap_in_revives_device_blocks_through_the_free_queue():
    bm = BlockManager(num_blocks=4, block_size=2, num_host_blocks=4)
    a = bm.new_table()
    alloc(bm, a, 0, 4)
    bm.cache_full_blocks(a, [1, 2, 3, 4], 4, None)
    b = bm.fork(a)
    bm.swap_out([a, b])
    assert list(bm.free_queue) == [2, 3, 0, 1]
    bm.swap_in([a, b])
    # Fresh blocks from the front of the queue: the cached blocks 0 and 1 stay findable.
    assert a.ids == b.ids == [2, 3] and list(bm.free_queue) == [0, 1]
    assert [bm.blocks[i].ref_cnt for i in (2, 3)] == [2, 2] and a.num_cached_blocks == 0
    for t in (a, b):
        bm.free(t)
    assert bm.num_free_blocks == 4 and all(blk.ref_cnt == 0 for blk in bm.blocks)


def test_freeing_one_swapped_sample_keeps_the_host_blocks_its_sibling_shares():
    bm = BlockManager(num_blocks=4, block_size=4, num_host_blocks=4)
    a = bm.new_table()
    alloc(bm, a, 0, 6)
    b = bm.fork(a)
    bm.swap_out([a, b])
    bm.free(b)  # b finished while swapped out
    assert b.ids == [] and not b.on_host
    assert len(bm.free_host_blocks) == 2  # a still holds host blocks 0 and 1
    assert bm.blocks_to_grow(a, 6, 7) == 0  # and no longer shares them
    bm.swap_in([a])
    assert len(bm.free_host_blocks) == 4


def test_fork_of_a_swapped_out_table_shares_host_blocks():
    bm = BlockManager(num_blocks=4, block_size=4, num_host_blocks=4)
    a = bm.new_table()
    alloc(bm, a, 0, 6)
    bm.swap_out([a])
    b = bm.fork(a)
    assert b.on_host and b.ids == a.ids and bm.host_ref_cnt[:2] == [2, 2]
    assert bm.num_free_blocks == 4  # no device block was touched
    bm.swap_in([a, b])
    assert bm.blocks[a[1]].ref_cnt == 2 and len(bm.free_host_blocks) == 4


def test_hash_chains_parent():
    h1 = hash_block(None, [1, 2], None)
    assert hash_block(h1, [3, 4], None) != hash_block(None, [3, 4], None)
    assert hash_block(None, [1, 2], "s") != h1


def test_rejects_empty_pool():
    with pytest.raises(ValueError, match="at least one block"):
        BlockManager(0, 16)
