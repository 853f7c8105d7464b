"""The prefix cache's host-memory tier: where evicted device blocks go instead of being lost.

When the block manager hands out a free device block that still holds a cached prefix, its
K/V is copied to a slot of a bounded host pool first, keyed by the same block hash (the
chained hash of block_manager.hash_block: parent, tokens, cache salt; a sliding group's
block by its group-qualified key). A later prefix lookup that misses the device continues
here; a hit takes a fresh device block and copies the slot back before the step that reads
it, which costs a host-to-device copy instead of a prefill of those tokens.

This class is the bookkeeping only, pure Python like the block manager: which key sits in
which slot, least recently used first. The copies are (device block, slot) and (slot, device
block) pairs in the scheduler's output; the model runner executes them, batched, on the
device's stream before the forward pass (model_runner.apply_block_ops).

Slots are numbered after the swap pool's host blocks (first_slot): one host pool, one pair of
copy lists, and the tensor-parallel step broadcast already carries them.

A slot that a step restores from is locked until that step's copies are issued: the copies
run offloads (device to host) before restores, so a slot evicted and refilled in the same
step would be overwritten before it is read.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional


class HostKVTier:
    def __init__(self, num_blocks: int, first_slot: int = 0):
        if num_blocks < 0:
            raise ValueError(f"the host KV tier needs num_blocks >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.first_slot = first_slot
        self.entries: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recent first
        # Popped from the end: lowest slots first, so a step's offloads land in runs of
        # consecutive slots (one host copy per run).
        self._free: list[int] = list(range(first_slot + num_blocks - 1, first_slot - 1, -1))
        self._locked: set[int] = set()
        self.num_stored = 0  # blocks copied in, since start
        self.num_restored = 0  # blocks copied back to the device
        self.num_evicted = 0  # entries dropped for room

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def slot_of(self, key: bytes) -> Optional[int]:
        return self.entries.get(key)

    def store(self, key: bytes) -> Optional[int]:
        """A slot for a device block about to be evicted, or None: the key is here already
        (same key, same K/V: it only becomes most recent), or every slot is locked."""
        if key in self.entries:
            self.entries.move_to_end(key)
            return None
        slot = self._take_slot()
        if slot is None:
            return None
        self.entries[key] = slot
        self.num_stored += 1
        return slot

    def _take_slot(self) -> Optional[int]:
        if self._free:
            return self._free.pop()
        for key, slot in self.entries.items():  # least recent first
            if slot not in self._locked:
                del self.entries[key]
                self.num_evicted += 1
                return slot
        return None

    def restore(self, key: bytes) -> int:
        """The slot to copy a hit back from; locked until unlock_all, and now most recent.
        The entry stays: the device copy may be evicted again, and the host one is still good."""
        slot = self.entries[key]
        self.entries.move_to_end(key)
        self._locked.add(slot)
        self.num_restored += 1
        return slot

    def unlock_all(self) -> None:
        """The step's copies are issued: its restores have read their slots (stream order)."""
        self._locked.clear()

    def forget(self, key: bytes) -> None:
        """Drop an entry whose copy in will not run (its slot holds nothing valid)."""
        slot = self.entries.pop(key, None)
        if slot is not None:
            self._free.append(slot)
            self.num_stored -= 1

    def clear(self) -> None:
        for slot in self.entries.values():
            self._free.append(slot)
        self.entries.clear()
        self._free.sort(reverse=True)
        self._locked.clear()

    @property
    def num_used(self) -> int:
        return len(self.entries)
