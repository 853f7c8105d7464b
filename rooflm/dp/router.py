"""Which data-parallel replica a new request goes to.

  round_robin   in turn, blind to load and prompt;
  least_loaded  the replica with the fewest unfinished requests (ties: fewest outstanding
                prompt + output tokens, then the lowest index);
  cache_aware   the replica whose prefix cache most likely holds the longest prefix of
                the prompt, unless it is overloaded against the least-loaded replica,
                when the request goes to the least-loaded one (SGLang's cache-aware
                router makes the same trade between hits and balance).

The router never asks a replica what its cache holds. It keeps, per replica, an
approximate prefix index: the block hashes (engine/block_manager.hash_block, so a
router block is an engine block) of the prompts it sent there, in LRU order, at
most `index_blocks` of them (about the replica's KV pool: an older prefix has
likely been evicted there too). A prompt's match on a replica is the number of
its leading block hashes that replica's index holds.

"Overloaded" is SGLang's pair of balance thresholds applied to the candidate:
it has more than `balance_abs` requests beyond the least-loaded replica *and*
more than `balance_rel` times its requests. Below both, the cache hit is worth
the wait; above, the queue costs more than the prefill the hit saves. SGLang's
router ships balance_abs_threshold 32 or 64 (by version) and balance_rel_threshold
1.5; rooflm takes 32 and 1.5 (engines here are one GPU each, queues short).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Optional, Protocol, Sequence

# cache_aware and round_robin as SGLang's router spells them; `serve --dp-routing` and `simulate
# --dp-routing` take these names and no others.
POLICIES = ("cache_aware", "round_robin", "least_loaded")


def canonical_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"router policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    return policy


class ReplicaLoad(Protocol):
    """What the router reads of a replica: the simulator's SimReplica and the server's
    per-replica counters both have it."""

    @property
    def num_unfinished(self) -> int: ...

    @property
    def outstanding_tokens(self) -> int: ...


class PrefixIndex:
    """One replica's approximate prefix cache: block hashes in LRU order, bounded."""

    def __init__(self, max_blocks: int):
        if max_blocks < 1:
            raise ValueError(f"a prefix index needs room for at least one block, got {max_blocks}")
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, block_hashes: Sequence[Hashable]) -> int:
        """How many leading blocks of the chain this index holds."""
        matched = 0
        for block_hash in block_hashes:
            if block_hash not in self._blocks:
                break
            matched += 1
        return matched

    def insert(self, block_hashes: Sequence[Hashable]) -> None:
        """Record that the replica now caches this chain (the most recently used end)."""
        for block_hash in block_hashes:
            self._blocks[block_hash] = None
            self._blocks.move_to_end(block_hash)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)


class Router:
    def __init__(self, policy: str, num_replicas: int, balance_abs: int = 32,
                 balance_rel: float = 1.5, index_blocks: int = 1 << 16):
        if num_replicas < 1:
            raise ValueError(f"need at least one replica, got {num_replicas}")
        if balance_abs < 0 or balance_rel < 1.0:
            raise ValueError(f"need balance_abs >= 0 and balance_rel >= 1, got {balance_abs} "
                             f"and {balance_rel}")
        self.policy = canonical_policy(policy)
        self.num_replicas = num_replicas
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.indexes = [PrefixIndex(index_blocks) for _ in range(num_replicas)]
        self._next = 0

    def pick(self, loads: Sequence[ReplicaLoad],
             block_hashes: Optional[Sequence[Hashable]] = None) -> int:
        """The replica for a request whose prompt's block-hash chain is `block_hashes`.

        The cache-aware policy records the chain in the chosen replica's index."""
        if len(loads) != self.num_replicas:
            raise ValueError(f"the router has {self.num_replicas} replicas, got {len(loads)} loads")
        if self.num_replicas == 1:
            return 0
        if self.policy == "round_robin":
            index = self._next % self.num_replicas
            self._next += 1
            return index
        least = least_loaded(loads)
        if self.policy == "least_loaded" or not block_hashes:
            return least
        choice = self._best_match(loads, block_hashes, least)
        self.indexes[choice].insert(block_hashes)
        return choice

    def _best_match(self, loads: Sequence[ReplicaLoad], block_hashes: Sequence[Hashable],
                    least: int) -> int:
        matches = [index.match(block_hashes) for index in self.indexes]
        longest = max(matches)
        if longest == 0:
            return least
        # Among the replicas with the longest match, the least loaded.
        best = min((i for i in range(self.num_replicas) if matches[i] == longest),
                   key=lambda i: _load_key(loads, i))
        if self.overloaded(loads[best].num_unfinished, loads[least].num_unfinished):
            return least
        return best

    def overloaded(self, candidate: int, least: int) -> bool:
        """SGLang's test: beyond both the absolute and the relative balance threshold."""
        return candidate - least > self.balance_abs and candidate > self.balance_rel * least


def least_loaded(loads: Sequence[ReplicaLoad]) -> int:
    return min(range(len(loads)), key=lambda i: _load_key(loads, i))


def _load_key(loads: Sequence[ReplicaLoad], i: int) -> tuple:
    return (loads[i].num_unfinished, loads[i].outstanding_tokens, i)
