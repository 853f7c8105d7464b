"""The data-parallel router on its own: policies, the prefix index, the balance thresholds."""

from dataclasses import dataclass

import pytest

from rooflm.dp.router import PrefixIndex, Router, canonical_policy
from rooflm.engine.block_manager import hash_block


@dataclass
class Load:
    num_unfinished: int = 0
    outstanding_tokens: int = 0


def chain(tokens: list[int], block_size: int = 4) -> list[bytes]:
    hashes, parent = [], None
    for i in range((len(tokens) - 1) // block_size):
        parent = hash_block(parent, tokens[i * block_size:(i + 1) * block_size], None)
        hashes.append(parent)
    return hashes


def test_round_robin_alternates_blind_to_load_and_prompt():
    router = Router("round_robin", 3)
    loads = [Load(9), Load(0), Load(0)]
    assert [router.pick(loads, chain(list(range(20)))) for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_least_loaded_breaks_ties_by_tokens_then_index():
    router = Router("least_loaded", 3)
    assert router.pick([Load(2, 10), Load(1, 50), Load(1, 40)]) == 2
    assert router.pick([Load(1, 40), Load(1, 40), Load(3, 0)]) == 0


def test_cache_aware_follows_the_longest_prefix_match():
    router = Router("cache_aware", 2)
    loads = [Load(), Load()]
    system = list(range(100, 132))  # 8 shared blocks
    first = router.pick(loads, chain(system + [1, 2, 3, 4, 5]))
    loads[first].num_unfinished += 1
    # The shared prefix pulls the next prompts to the same replica, though it is busier.
    for question in range(5):
        assert router.pick(loads, chain(system + [question] * 9)) == first
        loads[first].num_unfinished += 1
    # A prompt with nothing in common goes to the least-loaded replica.
    assert router.pick(loads, chain(list(range(500, 540)))) == 1 - first


def test_cache_aware_prefers_the_longer_match():
    router = Router("cache_aware", 2)
    loads = [Load(), Load()]
    short = list(range(8))
    long = list(range(40))
    router.indexes[0].insert(chain(short + [99]))  # 2 blocks of the long prompt
    router.indexes[1].insert(chain(long + [99]))  # all 10
    assert router.pick(loads, chain(long + [7])) == 1


def test_cache_aware_gives_way_to_balance_beyond_both_thresholds():
    router = Router("cache_aware", 2, balance_abs=4, balance_rel=1.5)
    prompt = chain(list(range(64)))
    router.indexes[0].insert(prompt)
    # 5 more than the other replica, but not 1.5x: keep the hit.
    assert router.pick([Load(15), Load(10)], prompt) == 0
    # 1.5x but only 3 more: keep the hit.
    assert router.pick([Load(6), Load(3)], prompt) == 0
    # Beyond both: least loaded, which now holds the prefix too.
    assert router.pick([Load(20), Load(3)], prompt) == 1
    assert router.indexes[1].match(prompt) == len(prompt)
    # Both match: the less loaded of the two.
    assert router.pick([Load(7), Load(6)], prompt) == 1


def test_prefix_index_is_bounded_and_evicts_least_recently_used():
    index = PrefixIndex(max_blocks=6)
    a, b = chain(list(range(17))), chain(list(range(1000, 1017)))  # 4 blocks each
    index.insert(a)
    index.insert(b)
    assert len(index) == 6
    assert index.match(b) == 4
    assert index.match(a) == 0  # its first blocks went first: the chain is broken
    index.insert(a[:1])  # touched again: most recent
    index.insert(chain(list(range(2000, 2005))))
    assert index.match(a) == 1


def test_policies_are_named_and_checked():
    assert canonical_policy("cache_aware") == "cache_aware"
    for other_spelling in ("cache-aware", "prefix-aware", "prefix_aware"):  # one name per policy
        with pytest.raises(ValueError, match="router policy must be one of cache_aware, round_robin"):
            canonical_policy(other_spelling)
    with pytest.raises(ValueError, match="router policy must be one of"):
        Router("random", 2)
    with pytest.raises(ValueError, match="the router has 2 replicas"):
        Router("least_loaded", 2).pick([Load()])
