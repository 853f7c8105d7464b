"""The prefix cache's host tier (engine/host_kv_tier.py): exact block ids, slots and keys
through eviction, lookup, restore, LRU order and the bound; no device."""

import pytest

from rooflm.config import SchedulerConfig
from rooflm.engine.block_manager import ON_HOST, BlockManager, group_key, hash_block
from rooflm.engine.host_kv_tier import HostKVTier
from rooflm.engine.request import Request
from rooflm.engine.scheduler import Scheduler
from rooflm.sampling_params import SamplingParams


def alloc(bm, table, computed, after):
    copies = []
    assert bm.allocate(table, computed, after, copies)
    return copies


def chain(tokens, block_size=4, salt=None):
    """The prefix hashes of each whole block of tokens."""
    hashes, parent = [], None
    for i in range(len(tokens) // block_size):
        parent = hash_block(parent, tokens[i * block_size:(i + 1) * block_size], salt)
        hashes.append(parent)
    return hashes


def cached_table(bm, tokens, salt=None):
    """A finished sequence's full blocks of `tokens`, registered, then freed."""
    t = bm.new_table()
    num_full = len(tokens) // bm.block_size * bm.block_size
    alloc(bm, t, 0, num_full)
    bm.cache_full_blocks(t, tokens, num_full, salt)
    ids = list(t.ids)
    bm.free(t)
    return ids


# ---- the tier alone ------------------------------------------------------------------------


def test_tier_evicts_least_recently_used_and_keeps_its_bound():
    tier = HostKVTier(3, first_slot=10)
    assert [tier.store(k) for k in (b"a", b"b", b"c")] == [10, 11, 12]
    assert tier.store(b"a") is None  # already here: made most recent, no copy
    assert tier.store(b"d") == 11  # b was least recent
    assert list(tier.entries) == [b"c", b"a", b"d"] and len(tier) == 3
    assert b"b" not in tier and tier.num_evicted == 1


def test_a_locked_slot_is_not_reused_until_the_step_is_issued():
    tier = HostKVTier(2)
    tier.store(b"a"), tier.store(b"b")
    assert tier.restore(b"a") == 0  # locked, and now most recent
    assert tier.store(b"c") == 1  # b goes, a stays
    assert tier.restore(b"c") == 1
    assert tier.store(b"d") is None  # every slot is locked: no room, no copy
    assert list(tier.entries) == [b"a", b"c"]
    tier.unlock_all()
    assert tier.store(b"d") == 0  # a is the least recent now
    assert list(tier.entries) == [b"c", b"d"]


# ---- the block manager with a tier -----------------------------------------------------------


def test_evicting_a_cached_block_offloads_it_under_its_hash():
    bm = BlockManager(num_blocks=4, block_size=4, num_host_blocks=2, num_offload_blocks=3)
    tokens = list(range(1, 13))  # 3 full blocks
    ids = cached_table(bm, tokens)
    assert ids == [0, 1, 2]
    assert list(bm.free_queue) == [3, 2, 1, 0]  # tail first
    t = bm.new_table()
    alloc(bm, t, 0, 12)  # takes 3 (never cached), then evicts 2 and 1
    assert t.ids == [3, 2, 1]
    offloads, restores = bm.take_block_ops()
    h = chain(tokens)
    # Slots are numbered after the swap pool's two host blocks.
    assert offloads == [(2, 2), (1, 3)] and restores == []
    assert bm.host_tier.entries == {h[2]: 2, h[1]: 3}
    assert h[2] not in bm.cached and h[1] not in bm.cached and bm.cached[h[0]] == 0
    assert bm.take_block_ops() == ([], [])  # taken once


def test_a_prefix_lookup_continues_into_the_host_tier_and_restores():
    bm = BlockManager(num_blocks=4, block_size=4, num_offload_blocks=4)
    tokens = list(range(1, 14))  # 3 full blocks + 1
    cached_table(bm, tokens)
    other = bm.new_table()
    alloc(bm, other, 0, 12)  # 3, 2, 1: evicts blocks 2 and 1 to slots 0 and 1
    bm.take_block_ops()
    bm.free(other)  # 3 was never hashed; 2 and 1 now hold nothing cached
    h = chain(tokens)
    hit = bm.find_cached_prefix(tokens, None)
    assert hit.block_ids == (0, ON_HOST, ON_HOST) and hit.num_tokens == 12
    assert hit.num_host_blocks == 2 and hit.num_host_tokens == 8
    assert list(hit.host_keys()) == [h[1], h[2]]
    t = bm.new_table()
    assert bm.blocks_to_admit([t], [hit]) == 3  # block 0 revived, two fresh blocks
    bm.take_cached_prefix(t, hit)
    # Free queue before: [0, 1, 2, 3]; 0 is taken by reference, then 1 and 2 are popped.
    assert t.ids == [0, 1, 2] and t.num_cached_blocks == 3
    offloads, restores = bm.take_block_ops()
    assert offloads == [] and restores == [(1, 1), (0, 2)]  # h[1] went to slot 1, h[2] to 0
    assert bm.cached[h[1]] == 1 and bm.cached[h[2]] == 2
    assert bm.blocks[1].block_hash == h[1] and bm.blocks[1].ref_cnt == 1
    # The host copies stay: the device ones may be evicted again.
    assert bm.host_tier.entries == {h[1]: 1, h[2]: 0}


def test_the_salt_is_part_of_the_host_key():
    bm = BlockManager(num_blocks=2, block_size=4, num_offload_blocks=4)
    tokens = list(range(1, 10))
    cached_table(bm, tokens, salt="tenant-a")
    t = bm.new_table()
    alloc(bm, t, 0, 8)  # evicts both
    bm.take_block_ops()
    bm.free(t)
    assert bm.find_cached_prefix(tokens, "tenant-b").num_tokens == 0
    assert bm.find_cached_prefix(tokens, None).num_tokens == 0
    assert bm.find_cached_prefix(tokens, "tenant-a").num_tokens == 8


def test_restore_slots_survive_the_evictions_the_restore_causes():
    """A one-slot-short tier: the pops for a restore evict device blocks whose offloads would
    take the very slots being restored from; the locks keep them."""
    bm = BlockManager(num_blocks=4, block_size=4, num_offload_blocks=2)
    a = list(range(1, 10))
    cached_table(bm, a)  # blocks 0, 1; the free queue is then [2, 3, 1, 0]
    t = bm.new_table()
    alloc(bm, t, 0, 16)  # 2, 3, then evicts 1 and 0 into slots 0 and 1
    assert t.ids == [2, 3, 1, 0] and bm.take_block_ops()[0] == [(1, 0), (0, 1)]
    b = list(range(100, 116))
    bm.cache_full_blocks(t, b, 16, None)
    bm.free(t)  # free queue [0, 1, 3, 2], every block holding a block of b
    hit = bm.find_cached_prefix(a, None)
    assert hit.block_ids == (ON_HOST, ON_HOST)
    u = bm.new_table()
    bm.take_cached_prefix(u, hit)
    offloads, restores = bm.take_block_ops()
    # Popping 0 and 1 evicts b's last two blocks, but both slots are locked: not offloaded.
    assert u.ids == [0, 1] and restores == [(1, 0), (0, 1)] and offloads == []
    ha, hb = chain(a), chain(b)
    assert list(bm.host_tier.entries) == [ha[0], ha[1]]  # restored: most recent, a[1] last
    # Unlocked now: b's first blocks evict a's entries, least recent first.
    v = bm.new_table()
    alloc(bm, v, 0, 8)
    offloads, _ = bm.take_block_ops()
    assert v.ids == [3, 2] and offloads == [(3, 1), (2, 0)]
    assert bm.host_tier.entries == {hb[1]: 1, hb[0]: 0}


def test_locked_slots_win_over_a_full_tier_within_one_step():
    bm = BlockManager(num_blocks=6, block_size=4, num_offload_blocks=1)
    a = list(range(1, 6))  # one full block
    cached_table(bm, a)  # block 0
    t = bm.new_table()
    alloc(bm, t, 0, 24)  # 1..5, then evicts 0 into slot 0
    bm.take_block_ops()
    c = list(range(50, 74))
    bm.cache_full_blocks(t, c, 24, None)
    bm.free(t)
    hit = bm.find_cached_prefix(a, None)
    assert hit.block_ids == (ON_HOST,)
    u = bm.new_table()
    bm.take_cached_prefix(u, hit)  # pops a cached block of c: its offload finds slot 0 locked
    offloads, restores = bm.take_block_ops()
    assert restores == [(0, u.ids[0])] and offloads == []
    assert list(bm.host_tier.entries) == [chain(a)[0]]


def test_two_sequences_hitting_one_host_block_share_its_device_copy():
    bm = BlockManager(num_blocks=4, block_size=4, num_offload_blocks=2)
    tokens = list(range(1, 6))
    cached_table(bm, tokens)
    t = bm.new_table()
    alloc(bm, t, 0, 16)
    bm.take_block_ops()
    bm.free(t)
    hits = [bm.find_cached_prefix(tokens, None) for _ in range(2)]
    tables = [bm.new_table(), bm.new_table()]
    assert bm.blocks_to_admit(tables, hits) == 1
    bm.take_cached_prefixes(list(zip(tables, hits)))
    assert tables[0].ids == tables[1].ids and bm.blocks[tables[0].ids[0]].ref_cnt == 2
    assert len(bm.take_block_ops()[1]) == 1


def test_reset_forgets_the_tier_and_speculative_growth_does_not_offload():
    bm = BlockManager(num_blocks=2, block_size=4, num_offload_blocks=2)
    tokens = list(range(1, 10))
    cached_table(bm, tokens)
    t = bm.new_table()
    alloc(bm, t, 0, 8)
    bm.discard_offloads()  # as Scheduler.grow_ahead does
    assert bm.take_block_ops() == ([], []) and len(bm.host_tier) == 0
    bm.free(t)
    cached_table(bm, tokens)
    alloc(bm, bm.new_table(), 0, 8)
    assert len(bm.host_tier) == 2
    bm.reset_prefix_cache()
    assert len(bm.host_tier) == 0 and bm.host_tier._free == [1, 0]


def test_no_tier_without_prefix_caching_or_blocks():
    assert BlockManager(4, 4, num_offload_blocks=0).host_tier is None
    assert BlockManager(4, 4, enable_prefix_caching=False, num_offload_blocks=8).host_tier is None


# ---- KV cache groups -------------------------------------------------------------------------


def test_sliding_group_blocks_go_to_the_tier_under_their_group_key():
    """One full and one sliding group (window 4, blocks of 4): a hit restores the full
    group's blocks and the sliding group's last block before the hit point."""
    bm = BlockManager(num_blocks=8, block_size=4, windows=(None, 4), num_offload_blocks=8)
    tokens = list(range(1, 14))  # 3 full blocks + 1
    t = bm.new_table()
    alloc(bm, t, 0, 13)
    bm.cache_full_blocks(t, tokens, 12, None)
    (g1,) = t.group_tables
    assert t.ids == [0, 1, 2, 3] and g1.ids == [4, 5, 6, 7]
    bm.free(t)
    other = bm.new_table()
    alloc(bm, other, 0, 16)  # every block: evicts all cached ones
    offloads, _ = bm.take_block_ops()
    h = chain(tokens)
    keys = set(bm.host_tier.entries)
    assert keys == {h[0], h[1], h[2], group_key(h[0], 1), group_key(h[1], 1), group_key(h[2], 1)}
    assert len(offloads) == 6
    bm.free(other)
    hit = bm.find_cached_prefix(tokens, None)
    assert hit.num_tokens == 12 and hit.block_ids == (ON_HOST,) * 3
    # Window 4 from position 12: the sliding group needs entry 2 only (keys 9..11).
    assert hit.group_blocks == ((2, (ON_HOST,)),) and hit.num_host_blocks == 4
    u = bm.new_table()
    bm.take_cached_prefix(u, hit)
    _, restores = bm.take_block_ops()
    (u1,) = u.group_tables
    assert u1.ids[:2] == [0, 0] and u1.num_freed == 2
    restored = {dev: slot for slot, dev in restores}
    assert len(restored) == 4
    assert bm.host_tier.entries[group_key(h[2], 1)] == restored[u1.ids[2]]
    assert [bm.host_tier.entries[k] for k in h] == [restored[b] for b in u.ids]


# ---- the scheduler ---------------------------------------------------------------------------


def make_request(rid, tokens, max_tokens=4):
    from rooflm.engine.request import Sequence

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    req = Request(rid, None, list(tokens), params, max_tokens)
    req.seqs.append(Sequence(0, 0, list(tokens), len(tokens)))
    return req


def test_the_scheduler_puts_the_tier_copies_in_the_step():
    bm = BlockManager(num_blocks=6, block_size=4, num_offload_blocks=6)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, reserve_new_tokens=False), bm)
    tokens = list(range(1, 14))
    cached_table(bm, tokens)  # blocks 0..2
    filler = bm.new_table()
    alloc(bm, filler, 0, 24)  # all six: evicts 0..2
    bm.take_block_ops()
    bm.free(filler)
    req = make_request("r", tokens)
    sched.add(req)
    out = sched.schedule()
    (sch,) = out.scheduled
    assert sch.start == 12 and sch.num_new_tokens == 1  # only the last token is computed
    # Evicted 2, 1, 0 in that order (the free queue after the filler was [3, 4, 5, 2, 1, 0]).
    assert [h for h, _ in out.blocks_to_swap_in] == [2, 1, 0]
    assert [d for _, d in out.blocks_to_swap_in] == req.seqs[0].block_table.ids[:3]
    assert bm.prefix_hits == 12 and bm.prefix_host_hits == 12


def test_preempted_swapping_and_the_tier_use_separate_host_blocks():
    bm = BlockManager(num_blocks=4, block_size=4, num_host_blocks=4, num_offload_blocks=4)
    tokens = list(range(1, 10))
    cached_table(bm, tokens)
    t = bm.new_table()
    alloc(bm, t, 0, 16)
    bm.take_block_ops()
    pairs = bm.swap_out([t])
    assert sorted(h for _, h in pairs) == [0, 1, 2, 3]  # the swap pool's blocks
    assert set(bm.host_tier.entries.values()) == {4, 5}  # the tier's, after them
    u = bm.new_table()
    alloc(bm, u, 0, 16)  # the swapped-out blocks' device copies go; nothing cached in them
    assert bm.take_block_ops() == ([], [])
    bm.free(u)
    back = bm.swap_in([t])
    assert len(back) == 4 and all(h < 4 for h, _ in back)


@pytest.mark.parametrize("n", [0, 3])
def test_blocks_to_admit_counts_a_fresh_block_per_host_entry(n):
    bm = BlockManager(num_blocks=8, block_size=4, num_offload_blocks=8)
    tokens = list(range(1, 4 * n + 2))
    cached_table(bm, tokens)
    t = bm.new_table()
    alloc(bm, t, 0, 32)
    bm.take_block_ops()
    bm.free(t)
    hit = bm.find_cached_prefix(tokens, None)
    assert hit.num_host_blocks == n and bm.blocks_to_admit([bm.new_table()], [hit]) == n


# ---- the simulator ---------------------------------------------------------------------------


def test_the_simulator_runs_the_tier_and_prices_its_copies():
    """Two prefix groups alternating through a pool that holds one: without the tier every
    return of a group recomputes its prefix; with it the prefix comes back from host memory,
    and each copied block adds its price to the step."""
    from rooflm.sim.replica import ReplicaConfig
    from rooflm.sim.simulator import SimConfig, simulate
    from rooflm.sim.workload import SimRequest
    from tests.unit.test_sim_engine_equivalence import SyntheticCostModel

    sched = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=256, max_model_len=256)
    requests = [SimRequest(float(i), 70, 4, prefix_group=i % 2, prefix_len=64) for i in range(6)]
    results = {}
    for blocks, price in ((0, 0.0), (64, 0.0), (64, 0.5)):
        cfg = SimConfig(ReplicaConfig(sched, num_blocks=20, block_size=4, max_model_len=256,
                                      num_offload_blocks=blocks, host_copy_s_per_block=price), ingress_s=0.0)
        results[blocks, price] = simulate(cfg, SyntheticCostModel(step_s=0.01), requests)
    cold, tier, priced = results[0, 0.0], results[64, 0.0], results[64, 0.5]
    # Blocks are freed tail first: only each prefix's first block outlives the other group.
    assert [r.num_cached_tokens for r in cold.records] == [0, 0] + [4] * 4
    assert [r.num_cached_tokens for r in tier.records] == [0, 0] + [64] * 4
    assert tier.num_steps == priced.num_steps and priced.duration_s > tier.duration_s + 0.5
