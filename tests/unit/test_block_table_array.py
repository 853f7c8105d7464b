"""The persistent block-table array equals the one rebuilt from the lists, step after step, through
every way the block manager changes tables: growth, prefix hits, forks with copy-on-write,
speculative trims, frees of finished sequences, swap-out and swap-in (preemption)."""

import random

import numpy as np
import pytest

from rooflm.engine.block_manager import BlockManager, PrefixHit
from rooflm.engine.block_table_array import BlockTableArray, block_table_array


def check(array: BlockTableArray, tables):
    got = array.gather(tables)
    want = block_table_array([t.ids for t in tables])
    assert got.dtype == np.int32 and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    return got


def test_growth_new_and_leaving_tables_and_order():
    bm = BlockManager(400, 4, enable_prefix_caching=False)
    array = BlockTableArray(rows=2, width=2)  # small, so rows and width must grow
    tables = [bm.new_table() for _ in range(5)]
    tokens = {id(t): 0 for t in tables}

    def grow(t, n):
        bm.allocate(t, tokens[id(t)], tokens[id(t)] + n, [])
        tokens[id(t)] += n

    for step in range(40):
        for i, t in enumerate(tables):
            grow(t, 1 + i % 3)
        check(array, tables)
        if step == 10:
            bm.free(tables[1])  # finished: its row is reused, shorter, by a new table
            tables[1] = bm.new_table()
            tokens[id(tables[1])] = 0
        if step == 20:
            tables.reverse()
        if step == 25:
            first = tables.pop(0)  # leaves the batch, comes back changed
            check(array, tables)
            grow(first, 60)
            tables.append(first)


def test_prefix_hit_fork_copy_on_write_and_trim():
    bm = BlockManager(200, 4)
    array = BlockTableArray()
    parent = bm.new_table()
    bm.allocate(parent, 0, 10, [])  # two full blocks and a partly filled third
    check(array, [parent])
    child = bm.fork(parent)
    check(array, [parent, child])
    copies = []
    bm.allocate(child, 10, 11, copies)  # the shared third block is copied: same length
    assert copies
    got = check(array, [parent, child])
    assert got[1, 2] != got[0, 2]
    bm.allocate(child, 11, 30, [])
    check(array, [child, parent])
    bm.trim(child, 12)  # rejected drafts
    check(array, [child, parent])
    hit = PrefixHit(tuple(parent.ids[:2]), 8)
    other = bm.new_table()
    bm.take_cached_prefix(other, hit)
    check(array, [parent, other, child])


def test_swap_out_and_in_rewrite_rows():
    bm = BlockManager(64, 4, num_host_blocks=64)
    array = BlockTableArray()
    tables = [bm.new_table() for _ in range(3)]
    for t in tables:
        bm.allocate(t, 0, 17, [])
    check(array, tables)
    bm.swap_out([tables[0]])  # preempted: not in the next steps
    bm.free(tables[1])  # and another finishes, so its blocks are handed out again
    fresh = bm.new_table()
    bm.allocate(fresh, 0, 20, [])
    check(array, [tables[2], fresh])
    bm.swap_in([tables[0]])  # back, with other device blocks
    check(array, [tables[0], tables[2], fresh])


@pytest.mark.parametrize("seed", range(4))
def test_random_workload_matches_rebuild(seed):
    rng = random.Random(seed)
    bm = BlockManager(3000, 16, num_host_blocks=3000)
    array = BlockTableArray(rows=4, width=4)
    live = []  # (table, computed tokens)
    swapped = []
    held = None
    for _ in range(300):
        op = rng.random()
        if op < 0.15 or not live:
            t = bm.new_table()
            n = rng.randrange(1, 200)
            bm.allocate(t, 0, n, [])
            live.append([t, n])
        elif op < 0.2:
            t, n = live.pop(rng.randrange(len(live)))
            bm.free(t)
        elif op < 0.25:
            t, n = live.pop(rng.randrange(len(live)))
            bm.swap_out([t])
            swapped.append([t, n])
        elif op < 0.3 and swapped:
            entry = swapped.pop(0)
            bm.swap_in([entry[0]])
            live.append(entry)
        elif op < 0.35:
            parent, n = rng.choice(live)
            live.append([bm.fork(parent), n])
        elif op < 0.4:
            entry = rng.choice(live)
            entry[1] = max(1, entry[1] - rng.randrange(8))
            bm.trim(entry[0], entry[1])
        for entry in live:
            if rng.random() < 0.8:
                step = rng.choice((1, 1, 1, 5))
                bm.allocate(entry[0], entry[1], entry[1] + step, [])
                entry[1] += step
        batch = [t for t, _ in live]
        rng.shuffle(batch)
        batch = batch[:rng.randrange(1, len(batch) + 1)]
        got = check(array, batch)
        if held is not None:  # an earlier step's array is the caller's: later steps leave it
            np.testing.assert_array_equal(held[0], held[1])
        held = (got, got.copy())


def test_every_change_is_seen_by_a_table_that_stays_in_the_batch():
    """Each kind of change between two consecutive gathers of the same table (the array reads
    BlockTable.version, so each one must bump it)."""
    bm = BlockManager(64, 4, num_host_blocks=64)
    array = BlockTableArray()
    donor, t = bm.new_table(), bm.new_table()
    bm.allocate(donor, 0, 12, [])
    bm.cache_full_blocks(donor, list(range(12)), 12, None)
    bm.allocate(t, 0, 9, [])
    check(array, [t, donor])
    bm.swap_out([t])
    check(array, [t, donor])
    bm.swap_in([t])
    check(array, [t, donor])
    bm.free(t)
    check(array, [t, donor])
    bm.take_cached_prefix(t, PrefixHit(tuple(donor.ids[:2]), 8))
    check(array, [t, donor])
