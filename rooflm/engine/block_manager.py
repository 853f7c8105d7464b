"""The paged KV cache's bookkeeping: which block holds which tokens. Pure Python.

- Blocks are fixed-size pages of one preallocated pool. A sequence's BlockTable
  lists its pages in order. The block manager hands tables out and is the only
  code that changes them; everyone else reads them, and finds the cache slot of
  a position with slot_of, the one place that formula lives.
- Free blocks wait in an LRU queue. A freed block that holds a full, hashed
  prefix stays findable in the prefix cache until it is handed out again, so
  allocation from the front of the queue evicts the least recently freed.
- A full block's hash chains its parent's hash with its own token ids (and the
  request's cache salt), so a hit means the whole prefix matches. Hits are
  counted in tokens (PrefixHit), the unit the scheduler's counters use.
- Blocks are shared by reference count: prefix hits, and the n samples of a
  request, which fork their parent's table. A shared block about to be written
  (the prompt's partly filled last block, after a fork) is copied first
  (copy-on-write); the copies are returned to the model runner to execute on
  the device before the step's forward pass.
- One growth rule, blocks_to_grow, says how many free blocks a step of a
  sequence takes (new blocks, plus a copy-on-write); the scheduler applies it
  to running, swapped-out and waiting requests alike.
- Host blocks for swap preemption have their own pool. They are reference
  counted too: the n samples of a request still share blocks while swapped out.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator, Optional


def slot_of(block_id, position, block_size: int):
    """The KV cache slot of a position held in block block_id (that is, block_ids[position //
    block_size] of its sequence): offset position % block_size of that block in the flattened
    pool. Python ints (the model runner's inputs) or int64 tensors (the speculative device
    loop's, spec/loop.py) alike."""
    return block_id * block_size + position % block_size


def slot_mapping(block_ids: list[int], start: int, n: int, block_size: int) -> list[int]:
    """The KV cache slots of positions start .. start + n - 1 of one sequence (slot_of each).
    Within a block the slots run consecutively, so they are added a block at a time.
    """
    index, offset = divmod(start, block_size)
    if 0 < n <= block_size - offset:  # within one block, as every decode token is
        first = slot_of(block_ids[index], start, block_size)
        return list(range(first, first + n))
    slots: list[int] = []
    pos, end = start, start + n
    while pos < end:
        index, offset = divmod(pos, block_size)
        run = min(block_size - offset, end - pos)
        first = slot_of(block_ids[index], pos, block_size)
        slots.extend(range(first, first + run))
        pos += run
    return slots


class BlockTable:
    """One sequence's KV blocks in order: the K/V of token p lives in block ids[p // block_size].

    Handed out and changed only by the BlockManager. Readers use len(), indexing,
    iteration, slots(), or `ids` itself (the live list, cheap to copy into an array
    each step: read it, never change it). `version` grows at every change of `ids`, so a
    reader that keeps a copy (the model runner's persistent block-table array) knows when
    it is stale without comparing the lists.
    """

    __slots__ = ("block_size", "ids", "num_cached_blocks", "on_host", "version")

    def __init__(self, block_size: int, ids: Optional[list[int]] = None):
        self.block_size = block_size
        self.ids: list[int] = ids if ids is not None else []
        # Leading blocks already registered in the prefix cache, so each block is hashed once.
        self.num_cached_blocks = 0
        # Swapped out: the ids name host blocks until the table is swapped back in.
        self.on_host = False
        self.version = 0

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index):
        return self.ids[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids)

    def __repr__(self) -> str:
        where = "host" if self.on_host else "device"
        return f"BlockTable({self.ids}, {where}, cached={self.num_cached_blocks})"

    def slots(self, start: int, n: int) -> list[int]:
        """Cache slots of positions start .. start + n - 1."""
        return slot_mapping(self.ids, start, n, self.block_size)

    def slot(self, position: int) -> int:
        """The cache slot of one position (a decode row)."""
        return slot_of(self.ids[position // self.block_size], position, self.block_size)


@dataclass(frozen=True)
class PrefixHit:
    """The longest cached whole-block prefix of a prompt: its blocks and the tokens they hold."""

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0


NO_HIT = PrefixHit()


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
        self.num_host_blocks = num_host_blocks
        self.free_host_blocks: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self.host_ref_cnt = [0] * num_host_blocks
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    # ---- queries ---------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def blocks_for_request(self, prompt_len: int, max_tokens: int, n: int = 1) -> int:
        """Most blocks a request can ever hold: its prompt's full blocks, shared by its n
        samples, plus each sample's own blocks from there to prompt + max_tokens tokens."""
        prompt_blocks = prompt_len // self.block_size
        return prompt_blocks + n * (self.blocks_needed(prompt_len + max_tokens) - prompt_blocks)

    def new_table(self) -> BlockTable:
        return BlockTable(self.block_size)

    def blocks_to_grow(self, table: BlockTable, num_computed: int, num_tokens_after: int,
                       hit: PrefixHit = NO_HIT) -> int:
        """Free blocks that extending `table` from num_computed to num_tokens_after tokens takes.

        That is the blocks past those the table holds (with the prefix hit it is about to
        take, for a waiting sequence), plus one if the next token lands in a shared, partly
        filled block, which is copied before it is written. A table on the host counts as
        it will be once swapped back in: its blocks stay shared as they were.
        """
        new_blocks = self._new_blocks_needed(table, num_tokens_after, hit)
        return new_blocks + self._needs_copy_on_write(table, num_computed)

    def blocks_to_admit(self, tables: list[BlockTable], hits: list[PrefixHit] = ()) -> int:
        """Free blocks a request's tables take before they grow: a device block for each
        host block of a swapped-out request, and each prefix-hit block that sits in the free
        queue (it stops being free once taken). Zero for a running request."""
        host_blocks = {b for table in tables if table.on_host for b in table.ids}
        revived = {b for hit in hits for b in hit.block_ids if self.blocks[b].ref_cnt == 0}
        return len(host_blocks) + len(revived)

    def _new_blocks_needed(self, table: BlockTable, num_tokens_after: int, hit: PrefixHit = NO_HIT) -> int:
        held = len(table.ids) + len(hit.block_ids)
        return max(0, self.blocks_needed(num_tokens_after) - held)

    def _needs_copy_on_write(self, table: BlockTable, num_computed: int) -> bool:
        """The next token lands in a partly filled block that another table also holds."""
        if num_computed % self.block_size == 0 or not table.ids:
            return False
        block_id = table.ids[num_computed // self.block_size]
        if table.on_host:
            return self.host_ref_cnt[block_id] > 1
        return self.blocks[block_id].ref_cnt > 1

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

    def find_cached_prefix(self, token_ids: list[int], salt: Optional[str]) -> PrefixHit:
        """The longest cached whole-block prefix of token_ids.

        The last token is never served from the cache: its logits are needed.
        """
        if not self.enable_prefix_caching:
            return NO_HIT
        max_blocks = (len(token_ids) - 1) // self.block_size
        hits: list[int] = []
        parent: Optional[bytes] = None
        for i in range(max_blocks):
            parent = hash_block(parent, token_ids[i * self.block_size:(i + 1) * self.block_size], salt)
            block_id = self.cached.get(parent)
            if block_id is None:
                break
            hits.append(block_id)
        if not hits:
            return NO_HIT
        return PrefixHit(tuple(hits), len(hits) * self.block_size)

    def take_cached_prefix(self, table: BlockTable, hit: PrefixHit) -> None:
        """Start an empty table with a prefix hit's blocks, by reference."""
        assert not table.ids, "a prefix hit starts an empty block table"
        for block_id in hit.block_ids:
            self._touch(block_id)
            table.ids.append(block_id)
        table.num_cached_blocks = len(hit.block_ids)  # they are registered already
        table.version += 1

    def allocate(self, table: BlockTable, num_computed: int, num_tokens_after: int,
                 copies: list[tuple[int, int]]) -> bool:
        """Make `table` hold tokens up to num_tokens_after; copy-on-write the block the next
        token lands in if it is shared. Appends (src, dst) block copies to `copies`.
        Returns False (changing nothing) when the pool is short."""
        assert not table.on_host, "swap a table in before it grows"
        # The two parts of blocks_to_grow, each worked out once.
        new_blocks = self._new_blocks_needed(table, num_tokens_after)
        copy = self._needs_copy_on_write(table, num_computed)
        if new_blocks + copy > self.num_free_blocks:
            return False
        if copy:
            self._copy_on_write(table, num_computed // self.block_size, copies)
        for _ in range(new_blocks):
            table.ids.append(self._pop_free())
        if new_blocks:
            table.version += 1
        return True

    def trim(self, table: BlockTable, num_tokens: int) -> None:
        """Free the table's blocks past those that hold num_tokens tokens (speculative
        decoding's rollback: blocks taken for drafts that were rejected)."""
        assert not table.on_host
        keep = self.blocks_needed(num_tokens)
        while len(table.ids) > keep:
            self._release(table.ids.pop())
            table.version += 1
        table.num_cached_blocks = min(table.num_cached_blocks, keep)

    def _copy_on_write(self, table: BlockTable, index: int, copies: list[tuple[int, int]]) -> None:
        src = table.ids[index]
        dst = self._pop_free()
        self._release(src)
        table.ids[index] = dst
        table.version += 1
        copies.append((src, dst))

    def fork(self, table: BlockTable) -> BlockTable:
        """A child sequence's table: it shares all of its parent's blocks, on the device or,
        for a request swapped out while its first sample was in flight, on the host."""
        child = BlockTable(self.block_size, list(table.ids))
        child.num_cached_blocks = table.num_cached_blocks
        child.on_host = table.on_host
        for block_id in table.ids:
            if table.on_host:
                self.host_ref_cnt[block_id] += 1
            else:
                self._touch(block_id)
        return child

    def free(self, table: BlockTable) -> None:
        """Release a sequence's blocks, on the device or the host. Device blocks go tail
        first: a tail is the least likely to be shared by a later prompt, so it should
        be evicted first."""
        if table.on_host:
            for host_id in table.ids:
                self._release_host(host_id)
        else:
            for block_id in reversed(table.ids):
                self._release(block_id)
        table.ids.clear()
        table.version += 1
        table.num_cached_blocks = 0
        table.on_host = False

    def cache_full_blocks(self, table: BlockTable, token_ids: list[int], num_known: int,
                          salt: Optional[str]) -> None:
        """Register the table's full blocks among its first num_known tokens (computed, ids
        on the host) in the prefix cache, past the num_cached_blocks already registered."""
        num_full = num_known // self.block_size
        if not self.enable_prefix_caching or num_full <= table.num_cached_blocks:
            return
        start = table.num_cached_blocks
        parent = self.blocks[table.ids[start - 1]].block_hash if start else None
        if start and parent is None:
            return  # reset_prefix_cache cut the chain: a hash without its parent would lie
        for i in range(start, num_full):
            block = self.blocks[table.ids[i]]
            if block.block_hash is not None:  # shared with a sibling or a prefix hit
                parent = block.block_hash
                continue
            parent = hash_block(parent, token_ids[i * self.block_size:(i + 1) * self.block_size], salt)
            block.block_hash = parent
            # If another block already holds this prefix, keep that one as the cache entry.
            self.cached.setdefault(parent, block.block_id)
        table.num_cached_blocks = num_full

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()

    # ---- swap (host memory) --------------------------------------------------------------

    def can_swap_out(self, tables: list[BlockTable]) -> bool:
        return len({b for table in tables for b in table.ids}) <= len(self.free_host_blocks)

    def swap_out(self, tables: list[BlockTable]) -> list[tuple[int, int]]:
        """Move a request's tables to host blocks. Shared device blocks move once.
        Returns (device, host) pairs."""
        mapping: dict[int, int] = {}
        for table in tables:
            assert not table.on_host
            for i, block_id in enumerate(table.ids):
                if block_id not in mapping:
                    mapping[block_id] = self.free_host_blocks.pop()
                host_id = mapping[block_id]
                self.host_ref_cnt[host_id] += 1
                self._release(block_id)
                table.ids[i] = host_id
            table.on_host = True
            table.version += 1
            table.num_cached_blocks = 0  # back on the device its blocks are new: register again
        return list(mapping.items())

    def swap_in(self, tables: list[BlockTable]) -> list[tuple[int, int]]:
        """Move a request's tables back to device blocks; the scheduler checked that enough
        are free (blocks_to_admit). Returns (host, device) pairs."""
        mapping: dict[int, int] = {}
        for table in tables:
            assert table.on_host
            for i, host_id in enumerate(table.ids):
                if host_id not in mapping:
                    mapping[host_id] = self._pop_free()
                else:
                    self._touch(mapping[host_id])
                self._release_host(host_id)
                table.ids[i] = mapping[host_id]
            table.on_host = False
            table.version += 1
        return list(mapping.items())

    def _release_host(self, host_id: int) -> None:
        self.host_ref_cnt[host_id] -= 1
        assert self.host_ref_cnt[host_id] >= 0, f"host block {host_id} freed more often than taken"
        if self.host_ref_cnt[host_id] == 0:
            self.free_host_blocks.append(host_id)
