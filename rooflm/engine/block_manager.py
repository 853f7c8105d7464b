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
- KV cache groups (kv_groups.py): with sliding-window layers in their own groups, a table
  carries one table per further group (group_tables), all over the same positions and the
  same pool. A sliding group's blocks wholly before the window of every query still to come
  are given back when the table grows (allocate); their entries become NULL_BLOCK, which the
  kernels may touch at a tile's start but whose keys they mask (a valid block: finite data).
  Group 0 is full attention and owns the prefix hashes; a sliding group's block carries its
  group-qualified hash. A prefix hit must also find every sliding group's blocks of the last
  W - 1 tokens before the hit point, or it is shortened to the longest point where they are.
- The host tier (host_kv_tier.py, --kv-offload-gb): a cached block handed out again (_pop_free)
  is first copied to a host slot under its key, and a lookup that misses the device continues
  there. A hit's host entries are ON_HOST in its ids until take_cached_prefixes gives each a
  fresh device block. The copies both ways wait in offloads / restores until the scheduler
  takes them for the step (take_block_ops), which runs them before its forward pass.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

from rooflm.engine.host_kv_tier import HostKVTier

# What a sliding group's table holds where its block was given back (below the window). The
# kernels' tiles start at a multiple of BLOCK_N, so they may read such an entry; its keys are
# masked, and block 0 holds finite K/V (the pool is zeroed, and only K/V is ever written).
NULL_BLOCK = 0

# A prefix hit's entry whose block is in the host tier, not on the device (yet).
ON_HOST = -1


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

    __slots__ = ("block_size", "ids", "num_cached_blocks", "on_host", "version", "num_freed", "group_tables")

    def __init__(self, block_size: int, ids: Optional[list[int]] = None, num_groups: int = 1):
        self.block_size = block_size
        self.ids: list[int] = ids if ids is not None else []
        # A sliding group's table: its first num_freed entries were given back (NULL_BLOCK).
        self.num_freed = 0
        # The tables of KV cache groups 1.. (kv_groups.py), same positions; empty with one group.
        self.group_tables: list[BlockTable] = [BlockTable(block_size) for _ in range(num_groups - 1)]
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
        freed = f", freed={self.num_freed}" if self.num_freed else ""
        groups = f", groups={self.group_tables}" if self.group_tables else ""
        return f"BlockTable({self.ids}, {where}, cached={self.num_cached_blocks}{freed}{groups})"

    def tables(self) -> list["BlockTable"]:
        """This table (group 0) and the other groups' tables, in group order."""
        return [self, *self.group_tables] if self.group_tables else [self]

    def live_ids(self) -> list[int]:
        """The blocks this table holds a reference to (past the given-back entries)."""
        return self.ids[self.num_freed:] if self.num_freed else self.ids

    def slots(self, start: int, n: int) -> list[int]:
        """Cache slots of positions start .. start + n - 1."""
        return slot_mapping(self.ids, start, n, self.block_size)

    def slot(self, position: int) -> int:
        """The cache slot of one position (a decode row)."""
        return slot_of(self.ids[position // self.block_size], position, self.block_size)


@dataclass(frozen=True)
class PrefixHit:
    """The longest cached whole-block prefix of a prompt: its blocks and the tokens they hold.
    group_blocks: for each KV cache group past the first, (first, ids): the group's blocks of
    table entries first .. first + len(ids) - 1; the entries before first are NULL_BLOCK.
    An id ON_HOST is in the host tier under its group's key of block_hashes[entry]."""

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0
    group_blocks: tuple[tuple[int, tuple[int, ...]], ...] = ()
    block_hashes: tuple[bytes, ...] = field(default=(), compare=False)  # group 0's hash of each entry
    num_host_blocks: int = 0  # ON_HOST entries over all groups

    def all_block_ids(self) -> Iterator[int]:
        """The device blocks of the hit, every group's."""
        for block_id in self.block_ids:
            if block_id != ON_HOST:
                yield block_id
        for _, ids in self.group_blocks:
            for block_id in ids:
                if block_id != ON_HOST:
                    yield block_id

    def host_keys(self) -> Iterator[bytes]:
        """The host tier's keys of the ON_HOST entries, every group's."""
        if not self.num_host_blocks:
            return
        for i, block_id in enumerate(self.block_ids):
            if block_id == ON_HOST:
                yield self.block_hashes[i]
        for g, (first, ids) in enumerate(self.group_blocks, start=1):
            for i, block_id in enumerate(ids, start=first):
                if block_id == ON_HOST:
                    yield group_key(self.block_hashes[i], g)

    @property
    def num_host_tokens(self) -> int:
        """Tokens of the hit whose (full-attention) blocks come back from the host tier."""
        if not self.num_host_blocks or not self.block_ids:
            return 0
        return self.num_tokens // len(self.block_ids) * sum(1 for b in self.block_ids if b == ON_HOST)


NO_HIT = PrefixHit()


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: Optional[bytes] = None  # set once the block is full and registered


def group_key(block_hash: bytes, group: int) -> bytes:
    """A block hash as group `group`'s prefix cache knows it: the groups share one pool and one
    table of hashes, and their blocks of the same tokens hold different layers."""
    return block_hash if group == 0 else block_hash + b"/g" + group.to_bytes(2, "little")


def hash_block(parent_hash: Optional[bytes], token_ids: list[int], salt: Optional[str],
               adapter: Optional[str] = None) -> bytes:
    """A collision-resistant key: a forged collision would leak another tenant's K/V.
    adapter: the request's LoRA adapter (LoRARequest.prefix_key): its K/V is another model's."""
    h = hashlib.sha256()
    h.update(parent_hash or b"root")
    h.update(array("q", token_ids).tobytes())
    if salt:
        h.update(b"salt:" + salt.encode("utf-8", "surrogatepass"))
    if adapter:
        # Length-prefixed: no salt text can spell an adapter's bytes.
        key = adapter.encode("utf-8", "surrogatepass")
        h.update(b"lora:" + len(key).to_bytes(8, "little") + key)
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0, windows: Sequence[Optional[int]] = (None,),
                 num_offload_blocks: int = 0):
        """windows: each KV cache group's window (kv_groups.KVLayout.windows), group 0 full.
        num_host_blocks: the swap pool's; num_offload_blocks: the prefix cache's host tier's,
        whose slots are numbered after the swap pool's."""
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        if not windows or windows[0] is not None:
            raise ValueError(f"KV cache group 0 must be full attention, got windows {tuple(windows)}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.windows = tuple(windows)
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # block_id -> None; ordered from least to most recently freed.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash (group_key) -> block id
        self.num_host_blocks = num_host_blocks
        self.free_host_blocks: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self.host_ref_cnt = [0] * num_host_blocks
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found
        self.prefix_host_hits = 0  # of which found in the host tier
        self.host_tier: Optional[HostKVTier] = None
        if num_offload_blocks > 0 and enable_prefix_caching:
            self.host_tier = HostKVTier(num_offload_blocks, first_slot=num_host_blocks)
        # The host tier's copies since take_block_ops: (device block, slot, key) out, (slot,
        # device block) back.
        self._offloads: list[tuple[int, int, bytes]] = []
        self._restores: list[tuple[int, int]] = []

    # ---- queries ---------------------------------------------------------------------

    @property
    def num_groups(self) -> int:
        return len(self.windows)

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
        samples, plus each sample's own blocks from there to prompt + max_tokens tokens; in
        a sliding group no more than its window and a whole-prompt step take."""
        prompt_blocks = prompt_len // self.block_size
        full = prompt_blocks + n * (self.blocks_needed(prompt_len + max_tokens) - prompt_blocks)
        total = 0
        for window in self.windows:
            if window is None:
                total += full
            else:
                total += min(full, n * (self.blocks_needed(window - 1 + prompt_len) + 1))
        return total

    def new_table(self) -> BlockTable:
        return BlockTable(self.block_size, num_groups=self.num_groups)

    def blocks_to_grow(self, table: BlockTable, num_computed: int, num_tokens_after: int,
                       hit: PrefixHit = NO_HIT) -> int:
        """Free blocks that extending `table` from num_computed to num_tokens_after tokens takes.

        That is the blocks past those the table holds (with the prefix hit it is about to
        take, for a waiting sequence), plus one if the next token lands in a shared, partly
        filled block, which is copied before it is written, in every group; less the sliding
        groups' blocks that allocate gives back first. A table on the host counts as
        it will be once swapped back in: its blocks stay shared as they were.
        """
        need = 0
        held_hit = len(hit.block_ids)
        for window, t in zip(self.windows, table.tables()):
            held = len(t.ids) + held_hit
            need += max(0, self.blocks_needed(num_tokens_after) - held) + self._needs_copy_on_write(t, num_computed)
            if window is not None and not t.on_host:
                need -= sum(1 for b in self._out_of_window(t, window, num_computed) if self.blocks[b].ref_cnt == 1)
        return max(0, need)

    def blocks_to_admit(self, tables: list[BlockTable], hits: list[PrefixHit] = ()) -> int:
        """Free blocks a request's tables take before they grow: a device block for each
        host block of a swapped-out request, and each prefix-hit block that sits in the free
        queue (it stops being free once taken). Zero for a running request."""
        host_blocks = {b for table in tables if table.on_host for t in table.tables() for b in t.live_ids()}
        revived = {b for hit in hits for b in hit.all_block_ids() if self.blocks[b].ref_cnt == 0}
        restored = {key for hit in hits for key in hit.host_keys()}
        return len(host_blocks) + len(revived) + len(restored)

    def _needs_copy_on_write(self, table: BlockTable, num_computed: int) -> bool:
        """The next token lands in a partly filled block that another table also holds."""
        if num_computed % self.block_size == 0 or not table.ids:
            return False
        block_id = table.ids[num_computed // self.block_size]
        if table.on_host:
            return self.host_ref_cnt[block_id] > 1
        return self.blocks[block_id].ref_cnt > 1

    def _out_of_window(self, table: BlockTable, window: int, num_computed: int) -> list[int]:
        """The live blocks of a sliding group's table that no query from position num_computed
        on reads: those wholly before num_computed - window + 1, the first key the next query
        sees (the decode kernel's kv_lo = seq_len - window; the prefill kernel's pos_lo - W + 1)."""
        first_key = num_computed - window + 1
        end = min(max(first_key, 0) // self.block_size, len(table.ids))
        return table.ids[table.num_freed:end] if end > table.num_freed else []

    # ---- allocation --------------------------------------------------------------------

    def _pop_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict its cached prefix
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
                if self.host_tier is not None:
                    self._offload(block_id, block.block_hash)
            block.block_hash = None
        block.ref_cnt = 1
        return block_id

    def _offload(self, block_id: int, key: bytes) -> None:
        """Copy an evicted cached block to the host tier, before the step that reuses it."""
        slot = self.host_tier.store(key)
        if slot is not None:
            self._offloads.append((block_id, slot, key))

    def take_block_ops(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The host tier's copies since the last call, for the step being scheduled:
        (device, slot) offloads, which run with the swap-outs (before anything writes a
        device block), and (slot, device) restores, with the swap-ins (before the forward)."""
        offloads = [(block_id, slot) for block_id, slot, _ in self._offloads]
        restores = self._restores
        self._offloads, self._restores = [], []
        if self.host_tier is not None:
            self.host_tier.unlock_all()
        return offloads, restores

    def discard_offloads(self) -> None:
        """Forget the offloads since the last take_block_ops: for allocations whose blocks are
        written before a step could copy them out (the speculative device loop's growth)."""
        for _, _, key in self._offloads:
            self.host_tier.forget(key)
        self._offloads = []

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

    def find_cached_prefix(self, token_ids: list[int], salt: Optional[str],
                           adapter: Optional[str] = None) -> PrefixHit:
        """The longest cached whole-block prefix of token_ids.

        The last token is never served from the cache: its logits are needed. With sliding
        groups, the hit ends where every sliding group also has its blocks of the window
        before it (see _window_hit).
        """
        if not self.enable_prefix_caching:
            return NO_HIT
        max_blocks = (len(token_ids) - 1) // self.block_size
        hits: list[int] = []
        hashes: list[bytes] = []
        parent: Optional[bytes] = None
        tier = self.host_tier
        for i in range(max_blocks):
            parent = hash_block(parent, token_ids[i * self.block_size:(i + 1) * self.block_size], salt, adapter)
            block_id = self.cached.get(parent)
            if block_id is None:
                if tier is None or parent not in tier:
                    break
                block_id = ON_HOST
            hits.append(block_id)
            hashes.append(parent)
        if len(self.windows) > 1:
            return self._window_hit(hits, hashes)
        if not hits:
            return NO_HIT
        on_host = hits.count(ON_HOST) if tier is not None else 0
        return PrefixHit(tuple(hits), len(hits) * self.block_size, block_hashes=tuple(hashes),
                         num_host_blocks=on_host)

    def _is_cached(self, key: bytes) -> bool:
        """On the device or in the host tier."""
        return key in self.cached or (self.host_tier is not None and key in self.host_tier)

    def _window_hit(self, hits: list[int], hashes: list[bytes]) -> PrefixHit:
        """The longest prefix of the full group's hit (m blocks) for which every other group
        has cached blocks for the entries the queries from the hit point on read: a sliding
        group those from (m * block_size - W + 1) // block_size to m - 1, a second full group
        all m. The simplest correct rule: a sliding group's blocks were given back, and are
        evicted, independently of the full group's."""
        runs = []  # per group: the length of the run of cached blocks ending at each entry
        for g in range(1, len(self.windows)):
            run, length = [], 0
            for h in hashes:
                length = length + 1 if self._is_cached(group_key(h, g)) else 0
                run.append(length)
            runs.append(run)
        m = len(hits)
        while m > 0 and not all(run[m - 1] >= m - self._first_kept(m, g) for g, run in enumerate(runs, start=1)):
            m -= 1
        if m == 0:
            return NO_HIT
        groups = []
        on_host = hits[:m].count(ON_HOST)
        for g in range(1, len(self.windows)):
            first = self._first_kept(m, g)
            ids = tuple(self.cached.get(group_key(h, g), ON_HOST) for h in hashes[first:m])
            on_host += ids.count(ON_HOST)
            groups.append((first, ids))
        return PrefixHit(tuple(hits[:m]), m * self.block_size, tuple(groups), tuple(hashes[:m]), on_host)

    def _first_kept(self, num_blocks: int, group: int) -> int:
        """The first table entry group `group` needs once num_blocks blocks are computed."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(num_blocks * self.block_size - window + 1, 0) // self.block_size

    def take_cached_prefix(self, table: BlockTable, hit: PrefixHit) -> None:
        """Start an empty table with a prefix hit's blocks, by reference."""
        self.take_cached_prefixes([(table, hit)])

    def take_cached_prefixes(self, hits: list[tuple[BlockTable, PrefixHit]]) -> None:
        """Start empty tables (a request's sequences) with their prefix hits' blocks: device
        blocks by reference; each host entry in a fresh device block, registered under its key,
        whose copy back waits in restores. All device references and host slots are taken
        before any block is popped, so that no pop evicts a block these hits hold; sequences
        that hit the same host entry share its one device copy."""
        for table, hit in hits:
            assert not table.ids, "a prefix hit starts an empty block table"
            for block_id in hit.all_block_ids():
                self._touch(block_id)
        slots: dict[bytes, int] = {}
        for _, hit in hits:
            for key in hit.host_keys():
                if key not in slots:
                    slots[key] = self.host_tier.restore(key)
        restored: dict[bytes, int] = {}
        for key, slot in slots.items():
            block_id = self._pop_free()
            self.blocks[block_id].block_hash = key
            self.cached.setdefault(key, block_id)
            self._restores.append((slot, block_id))
            restored[key] = block_id
        unclaimed = set(restored.values())
        for table, hit in hits:
            keys = iter(hit.host_keys())
            self._fill(table, 0, hit.block_ids, keys, restored, unclaimed)
            table.num_cached_blocks = len(hit.block_ids)  # they are registered already
            for t, (first, ids) in zip(table.group_tables, hit.group_blocks):
                self._fill(t, first, ids, keys, restored, unclaimed)
                t.num_cached_blocks = len(hit.block_ids)

    def _fill(self, table: BlockTable, first: int, ids: tuple[int, ...], keys: Iterator[bytes],
              restored: dict[bytes, int], unclaimed: set[int]) -> None:
        """Entries first.. of a table from a hit's ids (referenced already), ON_HOST ones from
        their restored blocks (host_keys order); the entries before first are given back."""
        table.ids.extend([NULL_BLOCK] * first)
        for block_id in ids:
            if block_id == ON_HOST:
                block_id = restored[next(keys)]
                if block_id in unclaimed:
                    unclaimed.remove(block_id)  # the pop's reference is this entry's
                else:
                    self._touch(block_id)
            table.ids.append(block_id)
        table.num_freed = first
        table.version += 1

    def allocate(self, table: BlockTable, num_computed: int, num_tokens_after: int,
                 copies: list[tuple[int, int]]) -> bool:
        """Make `table` hold tokens up to num_tokens_after; copy-on-write the block the next
        token lands in if it is shared. Appends (src, dst) block copies to `copies`.
        A sliding group first gives back its blocks before the window (always right to do).
        Returns False (changing nothing else) when the pool is short."""
        assert not table.on_host, "swap a table in before it grows"
        tables = table.tables()
        for window, t in zip(self.windows, tables):
            if window is not None:
                self._give_back(t, window, num_computed)
        # The two parts of blocks_to_grow, each worked out once per group.
        needed = self.blocks_needed(num_tokens_after)
        plan = [(t, max(0, needed - len(t.ids)), self._needs_copy_on_write(t, num_computed)) for t in tables]
        if sum(new + copy for _, new, copy in plan) > self.num_free_blocks:
            return False
        for t, new_blocks, copy in plan:
            if copy:
                self._copy_on_write(t, num_computed // self.block_size, copies)
            for _ in range(new_blocks):
                t.ids.append(self._pop_free())
            if new_blocks:
                t.version += 1
        return True

    def _give_back(self, table: BlockTable, window: int, num_computed: int) -> None:
        """Release a sliding group's blocks before the window, oldest first (evicted first)."""
        gone = self._out_of_window(table, window, num_computed)
        if not gone:
            return
        for i, block_id in enumerate(gone, start=table.num_freed):
            self._release(block_id)
            table.ids[i] = NULL_BLOCK
        table.num_freed += len(gone)
        table.version += 1

    def trim(self, table: BlockTable, num_tokens: int) -> None:
        """Free the table's blocks past those that hold num_tokens tokens (speculative
        decoding's rollback: blocks taken for drafts that were rejected)."""
        assert not table.on_host
        keep = self.blocks_needed(num_tokens)
        for t in table.tables():
            while len(t.ids) > keep:
                block_id = t.ids.pop()
                if len(t.ids) >= t.num_freed:
                    self._release(block_id)
                t.version += 1
            t.num_freed = min(t.num_freed, len(t.ids))
            t.num_cached_blocks = min(t.num_cached_blocks, keep)

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
        child = BlockTable(self.block_size, num_groups=self.num_groups)
        for src, dst in zip(table.tables(), child.tables()):
            dst.ids = list(src.ids)
            dst.num_cached_blocks = src.num_cached_blocks
            dst.num_freed = src.num_freed
            dst.on_host = src.on_host
            for block_id in src.live_ids():
                if src.on_host:
                    self.host_ref_cnt[block_id] += 1
                else:
                    self._touch(block_id)
        return child

    def free(self, table: BlockTable) -> None:
        """Release a sequence's blocks, on the device or the host. Device blocks go tail
        first: a tail is the least likely to be shared by a later prompt, so it should
        be evicted first."""
        for t in table.tables():
            if t.on_host:
                for host_id in t.live_ids():
                    self._release_host(host_id)
            else:
                for block_id in reversed(t.live_ids()):
                    self._release(block_id)
            t.ids.clear()
            t.version += 1
            t.num_cached_blocks = 0
            t.num_freed = 0
            t.on_host = False

    def cache_full_blocks(self, table: BlockTable, token_ids: list[int], num_known: int,
                          salt: Optional[str], adapter: Optional[str] = None) -> None:
        """Register the table's full blocks among its first num_known tokens (computed, ids
        on the host) in the prefix cache, past the num_cached_blocks already registered; the
        other groups' live blocks of the same entries under their group's key."""
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
            parent = hash_block(parent, token_ids[i * self.block_size:(i + 1) * self.block_size], salt, adapter)
            block.block_hash = parent
            # If another block already holds this prefix, keep that one as the cache entry.
            self.cached.setdefault(parent, block.block_id)
        table.num_cached_blocks = num_full
        for g, t in enumerate(table.group_tables, start=1):
            for i in range(max(t.num_cached_blocks, t.num_freed), num_full):
                block = self.blocks[t.ids[i]]
                if block.block_hash is None:
                    block.block_hash = group_key(self.blocks[table.ids[i]].block_hash, g)
                    self.cached.setdefault(block.block_hash, block.block_id)
            t.num_cached_blocks = num_full

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int, num_host_hit_tokens: int = 0) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens
        self.prefix_host_hits += num_host_hit_tokens

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        if self.host_tier is not None:
            self.host_tier.clear()

    # ---- swap (host memory) --------------------------------------------------------------

    def can_swap_out(self, tables: list[BlockTable]) -> bool:
        return len({b for table in tables for t in table.tables() for b in t.live_ids()}) <= len(self.free_host_blocks)

    def swap_out(self, tables: list[BlockTable]) -> list[tuple[int, int]]:
        """Move a request's tables (every group's) to host blocks. Shared device blocks move
        once; given-back entries stay NULL_BLOCK. Returns (device, host) pairs."""
        mapping: dict[int, int] = {}
        for table in tables:
            for t in table.tables():
                assert not t.on_host
                for i in range(t.num_freed, len(t.ids)):
                    block_id = t.ids[i]
                    if block_id not in mapping:
                        mapping[block_id] = self.free_host_blocks.pop()
                    host_id = mapping[block_id]
                    self.host_ref_cnt[host_id] += 1
                    self._release(block_id)
                    t.ids[i] = host_id
                t.on_host = True
                t.version += 1
                t.num_cached_blocks = 0  # back on the device its blocks are new: register again
        return list(mapping.items())

    def swap_in(self, tables: list[BlockTable]) -> list[tuple[int, int]]:
        """Move a request's tables back to device blocks; the scheduler checked that enough
        are free (blocks_to_admit). Returns (host, device) pairs."""
        mapping: dict[int, int] = {}
        for table in tables:
            for t in table.tables():
                assert t.on_host
                for i in range(t.num_freed, len(t.ids)):
                    host_id = t.ids[i]
                    if host_id not in mapping:
                        mapping[host_id] = self._pop_free()
                    else:
                        self._touch(mapping[host_id])
                    self._release_host(host_id)
                    t.ids[i] = mapping[host_id]
                t.on_host = False
                t.version += 1
        return list(mapping.items())

    def _release_host(self, host_id: int) -> None:
        self.host_ref_cnt[host_id] -= 1
        assert self.host_ref_cnt[host_id] >= 0, f"host block {host_id} freed more often than taken"
        if self.host_ref_cnt[host_id] == 0:
            self.free_host_blocks.append(host_id)
