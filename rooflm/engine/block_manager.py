"""The paged KV cache's bookkeeping: which block holds which tokens. Pure Python.

- Blocks are fixed-size pages of one preallocated pool; a sequence's block
  table lists its pages in order.
- Free blocks wait in an LRU queue. A freed block that holds a full, hashed
  prefix stays findable in the prefix cache until it is handed out again, so
  allocation from the front of the queue evicts the least recently freed.
- A full block's hash chains its parent's hash with its own token ids (and the
  request's cache salt), so a hit means the whole prefix matches.
- Blocks are shared by reference count: prefix hits, and the n samples of a
  request, which fork their parent's table. A shared block about to be written
  (the prompt's partly filled last block, after a fork) is copied first
  (copy-on-write); the copies are returned to the model runner to execute on
  the device before the step's forward pass.
- Host blocks for swap preemption have their own, simpler pool.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: Optional[bytes] = None  # set once the block is full and registered


def hash_block(parent_hash: Optional[bytes], token_ids: list[int], salt: Optional[str]) -> bytes:
    """A collision-resistant key: a forged collision would leak another tenant's K/V."""
    h = hashlib.sha256()
    h.update(parent_hash or b"root")
    h.update(array("q", token_ids).tobytes())
    if salt:
        h.update(b"salt:" + salt.encode("utf-8", "surrogatepass"))
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # block_id -> None; ordered from least to most recently freed.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self.free_host_blocks: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self.num_host_blocks = num_host_blocks
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    # ---- queries ---------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- allocation --------------------------------------------------------------------

    def _pop_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict its cached prefix
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_cnt = 1
        return block_id

    def _touch(self, block_id: int) -> None:
        """Take a reference to a block, reviving it from the free queue if needed."""
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            del self.free_queue[block_id]
        block.ref_cnt += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_cnt -= 1
        assert block.ref_cnt >= 0, f"block {block_id} freed more often than taken"
        if block.ref_cnt == 0:
            self.free_queue[block_id] = None

    def find_cached_prefix(self, token_ids: list[int], salt: Optional[str]) -> list[int]:
        """Block ids holding the longest cached whole-block prefix of token_ids.

        The last token is never served from the cache: its logits are needed.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (len(token_ids) - 1) // self.block_size
        hits: list[int] = []
        parent: Optional[bytes] = None
        for i in range(max_blocks):
            parent = hash_block(parent, token_ids[i * self.block_size:(i + 1) * self.block_size], salt)
            block_id = self.cached.get(parent)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, num_new_blocks: int, cached_hits: list[int] = ()) -> bool:
        # Hit blocks sitting in the free queue stop being free once taken.
        revived = sum(1 for b in cached_hits if self.blocks[b].ref_cnt == 0)
        return num_new_blocks + revived <= self.num_free_blocks

    def take_cached_prefix(self, block_table: list[int], hits: list[int]) -> None:
        assert not block_table, "a prefix hit starts an empty block table"
        for block_id in hits:
            self._touch(block_id)
            block_table.append(block_id)

    def slots_needed(self, block_table: list[int], num_tokens_after: int) -> int:
        """New blocks a table needs to hold num_tokens_after tokens."""
        return max(0, self.blocks_needed(num_tokens_after) - len(block_table))

    def cow_needed(self, block_table: list[int], num_computed: int) -> int:
        """1 if the next write lands in a shared, partly filled block."""
        if num_computed % self.block_size == 0 or not block_table:
            return 0
        last = block_table[num_computed // self.block_size]
        return 1 if self.blocks[last].ref_cnt > 1 else 0

    def allocate_slots(self, block_table: list[int], num_computed: int, num_tokens_after: int,
                       copies: list[tuple[int, int]]) -> bool:
        """Make block_table hold tokens up to num_tokens_after; copy-on-write the block the
        next token lands in if it is shared. Appends (src, dst) block copies to `copies`.
        Returns False (changing nothing) when the pool is short."""
        need = self.slots_needed(block_table, num_tokens_after)
        cow = self.cow_needed(block_table, num_computed)
        if need + cow > self.num_free_blocks:
            return False
        if cow:
            idx = num_computed // self.block_size
            src = block_table[idx]
            dst = self._pop_free()
            self._release(src)
            block_table[idx] = dst
            copies.append((src, dst))
        for _ in range(need):
            block_table.append(self._pop_free())
        return True

    def fork(self, block_table: list[int]) -> list[int]:
        """A child sequence shares all of its parent's blocks."""
        for block_id in block_table:
            self._touch(block_id)
        return list(block_table)

    def free(self, block_table: list[int]) -> None:
        """Release a sequence's blocks, tail first: its tail is the least likely to be
        shared by a later prompt, so it should be evicted first."""
        for block_id in reversed(block_table):
            self._release(block_id)
        block_table.clear()

    def cache_full_blocks(self, token_ids: list[int], block_table: list[int], num_computed: int,
                          salt: Optional[str], num_cached_blocks: int) -> int:
        """Register the full, computed blocks of a sequence past the first num_cached_blocks
        in the prefix cache. Returns the new count, so each block is hashed once."""
        num_full = num_computed // self.block_size
        if not self.enable_prefix_caching or num_full <= num_cached_blocks:
            return num_full
        parent = self.blocks[block_table[num_cached_blocks - 1]].block_hash if num_cached_blocks else None
        for i in range(num_cached_blocks, num_full):
            block = self.blocks[block_table[i]]
            if block.block_hash is not None:  # shared with a sibling or a prefix hit
                parent = block.block_hash
                continue
            parent = hash_block(parent, token_ids[i * self.block_size:(i + 1) * self.block_size], salt)
            block.block_hash = parent
            # If another block already holds this prefix, keep that one as the cache entry.
            self.cached.setdefault(parent, block.block_id)
        return num_full

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()

    # ---- swap (host memory) --------------------------------------------------------------

    def can_swap_out(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_host_blocks)

    def swap_out(self, tables: list[list[int]]) -> list[tuple[int, int]]:
        """Move tables to host blocks. Shared device blocks move once. Returns (device, host) pairs."""
        mapping: dict[int, int] = {}
        for table in tables:
            for i, block_id in enumerate(table):
                if block_id not in mapping:
                    mapping[block_id] = self.free_host_blocks.pop()
                self._release(block_id)
                table[i] = mapping[block_id]
        return list(mapping.items())

    def swap_in(self, tables: list[list[int]]) -> list[tuple[int, int]]:
        """Move tables back to device blocks. Returns (host, device) pairs."""
        mapping: dict[int, int] = {}
        for table in tables:
            for i, host_id in enumerate(table):
                if host_id not in mapping:
                    mapping[host_id] = self._pop_free()
                else:
                    self.blocks[mapping[host_id]].ref_cnt += 1
                table[i] = mapping[host_id]
        self.free_host_blocks.extend(mapping.keys())
        return list(mapping.items())

    def free_host(self, tables: list[list[int]]) -> None:
        """Drop a swapped-out request's host blocks (abort while swapped)."""
        seen: set[int] = set()
        for table in tables:
            seen.update(table)
            table.clear()
        self.free_host_blocks.extend(seen)

    @staticmethod
    def num_unique_blocks(tables: list[list[int]]) -> int:
        return len({b for table in tables for b in table})
