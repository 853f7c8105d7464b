"""KV cache groups in the block manager (engine/kv_groups.py, block_manager.py), exactly: block
ids, the order blocks are given back, admission counts over groups, preemption, prefix hits
shortened to where the sliding group still has its window."""

from rooflm.engine.block_manager import NULL_BLOCK, BlockManager, group_key
from rooflm.engine.kv_groups import blocks_per_seq, kv_layout, layer_blocks_per_seq, single_group


def test_layout_groups_equal_sizes_full_first():
    gemma3 = [None if i % 6 == 5 else 1024 for i in range(48)]
    layout = kv_layout(gemma3, 32768)
    assert layout.group_size == 8
    assert layout.windows == (None, 1024, 1024, 1024, 1024, 1024)
    assert layout.groups[0].layers == tuple(range(5, 48, 6))
    assert layout.groups[1].layers == (0, 1, 2, 3, 4, 6, 7, 8)
    assert layout.slot_of_layer(6) == 5 and layout.group_of_layer(6) == 1
    # No full layer, a window past the context, or switched off: one table.
    assert kv_layout([4096] * 32, 32768) == single_group(32)
    assert kv_layout(gemma3, 1024) == single_group(48)
    assert kv_layout(gemma3, 32768, hybrid=False) == single_group(48)


def test_blocks_per_seq_at_32k_is_a_fifth_of_full_history():
    layout = kv_layout([None if i % 6 == 5 else 1024 for i in range(48)], 32768)
    # full group 512 blocks; each sliding group ceil(1023/64) + 2 = 18
    assert blocks_per_seq(layout, 32768, 64) == 512 + 5 * 18
    assert layer_blocks_per_seq(layout, 32768, 64) == 8 * 602
    assert layer_blocks_per_seq(single_group(48), 32768, 64) == 48 * 512


def _manager(num_blocks=10, window=8):
    return BlockManager(num_blocks, 4, windows=(None, window))


def test_sliding_group_gives_back_blocks_before_the_window_oldest_first():
    bm = _manager()
    table = bm.new_table()
    sliding = table.group_tables[0]
    assert bm.blocks_to_grow(table, 0, 12) == 6
    assert bm.allocate(table, 0, 12, [])
    assert table.ids == [0, 1, 2] and sliding.ids == [3, 4, 5]
    # Next query at 12 reads keys 5..12: entry 0 (tokens 0..3) is wholly before the window.
    assert bm.blocks_to_grow(table, 12, 13) == 2 - 1
    assert bm.allocate(table, 12, 13, [])
    assert table.ids == [0, 1, 2, 6] and sliding.ids == [NULL_BLOCK, 4, 5, 7] and sliding.num_freed == 1
    assert list(bm.free_queue) == [8, 9, 3]
    # A decode inside the block frees nothing more; at 16, keys 9.. are read: entry 1 goes.
    assert bm.allocate(table, 14, 15, [])
    assert sliding.num_freed == 1
    assert bm.allocate(table, 16, 17, [])
    assert table.ids == [0, 1, 2, 6, 8] and sliding.ids == [NULL_BLOCK, NULL_BLOCK, 5, 7, 9]
    assert list(bm.free_queue) == [3, 4]


def test_admission_counts_every_group_and_preemption_frees_both():
    bm = _manager(num_blocks=7)
    a, b = bm.new_table(), bm.new_table()
    assert bm.allocate(a, 0, 8, [])  # 2 + 2 blocks
    assert bm.num_free_blocks == 3
    assert bm.blocks_to_grow(b, 0, 8) == 4
    assert not bm.allocate(b, 0, 8, [])  # 4 > 3: nothing taken
    assert b.ids == [] and b.group_tables[0].ids == [] and bm.num_free_blocks == 3
    # A 4-token step fits (1 + 1).
    assert bm.allocate(b, 0, 4, [])
    assert bm.num_free_blocks == 1
    bm.free(a)  # preemption by recompute: both groups' blocks, tail first
    assert list(bm.free_queue) == [6, 1, 0, 3, 2]
    assert a.ids == [] and a.group_tables[0].ids == [] and a.group_tables[0].num_freed == 0
    assert bm.blocks_for_request(8, 100) == 27 + min(27, bm.blocks_needed(8 - 1 + 8) + 1)


def test_fork_and_swap_keep_given_back_entries():
    bm = BlockManager(12, 4, windows=(None, 8), num_host_blocks=8)
    table = bm.new_table()
    assert bm.allocate(table, 0, 12, []) and bm.allocate(table, 12, 13, [])
    child = bm.fork(table)
    assert child.group_tables[0].ids == [NULL_BLOCK, 4, 5, 7] and child.group_tables[0].num_freed == 1
    assert bm.blocks[4].ref_cnt == 2 and bm.blocks[3].ref_cnt == 0
    pairs = bm.swap_out([table, child])
    assert sorted(d for d, _ in pairs) == [0, 1, 2, 4, 5, 6, 7]
    assert table.group_tables[0].ids[0] == NULL_BLOCK and table.group_tables[0].on_host
    assert bm.blocks_to_admit([table, child]) == 7
    bm.swap_in([table, child])
    assert table.group_tables[0].ids[0] == NULL_BLOCK and len(set(table.group_tables[0].ids[1:])) == 3
    bm.free(table)
    bm.free(child)
    assert bm.num_free_blocks == 12 and bm.free_host_blocks and all(c == 0 for c in bm.host_ref_cnt)


def _run_prompt(bm, tokens):
    table = bm.new_table()
    assert bm.allocate(table, 0, len(tokens), [])
    bm.cache_full_blocks(table, tokens, len(tokens), None)
    assert bm.allocate(table, len(tokens), len(tokens) + 1, [])  # the first decode gives back
    return table


def test_prefix_hit_brings_the_window_or_is_shortened():
    bm = _manager(num_blocks=40)
    tokens = list(range(100, 120))  # 5 blocks
    table = _run_prompt(bm, tokens)
    sliding = table.group_tables[0]
    assert sliding.num_freed == 3  # keys from 20 - 8 + 1 = 13 on: entries 3, 4
    kept = list(sliding.ids[3:5])  # entry 5: the decode's new block
    given_back = [bm.cached[group_key(bm.blocks[table.ids[i]].block_hash, 1)] for i in range(3)]
    bm.free(table)
    prompt = tokens + [1, 2, 3, 4, 5]
    hit = bm.find_cached_prefix(prompt, None)
    # At 20 tokens the next query reads keys 13..: entries 3 and 4 of the sliding group.
    assert hit.num_tokens == 20 and hit.group_blocks == ((3, tuple(kept)),)
    assert bm.blocks_to_admit([bm.new_table()], [hit]) == 7
    # Evict entry 3's block: no hit point past 12 tokens has its window (at 16 entries 2, 3 are
    # needed); at 12, entries 1 and 2 (given back, still cached) serve.
    bm.free_queue.move_to_end(kept[0], last=False)
    bm._pop_free()
    hit = bm.find_cached_prefix(prompt, None)
    assert hit.num_tokens == 12 and hit.group_blocks == ((1, tuple(given_back[1:3])),)
    new = bm.new_table()
    bm.take_cached_prefix(new, hit)
    assert new.group_tables[0].ids == [NULL_BLOCK] + given_back[1:3] and new.group_tables[0].num_freed == 1
    assert all(bm.blocks[b].ref_cnt == 1 for b in given_back[1:3])
