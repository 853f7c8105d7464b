"""KV cache groups: sliding-window layers hold only their window (vLLM's hybrid allocator idea).

A sliding-window layer (Gemma 2/3, gpt-oss) reads only the last W keys, yet with one block table
for all layers it keeps its whole history. Here the layers are split into groups of equal size,
each group all full-attention or all of one window; every group has its own block table per
sequence, and a sliding group's blocks that fall wholly outside the window of every query still
to come go back to the pool as the sequence advances.

All groups draw from ONE pool of blocks. A block is `group_size` layers' K/V of block_size tokens:
the pool is [group_size, 2, num_blocks, block_size, H_kv, D], and layer l of group g reads slot
`slot_of_layer[l]` of it through group g's table. So the free count is one number (admission is
unchanged), a sequence's short contexts cost no more than before, and blocks a sliding group
frees serve the full group's growth. Groups have equal sizes for this: the group size is the
fewest layers of any kind (Gemma 3 12B: 8 global layers, so one full group and five sliding
groups of 8; Gemma 2: 21 and 21). A kind whose layer count the size does not divide leaves
slots of its last group unused.

Group 0 is always full attention: prefix hashes are its blocks' (block_manager.py), and a
model without full-attention layers (Mistral v0.1, every layer sliding) keeps one table.
A window at least max_model_len long is full attention here (it never drops a key).

Pure Python, no device: the block manager, the runner, `rooflm memory` and the simulator share it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class KVGroup:
    window: Optional[int]  # None: full attention
    layers: tuple[int, ...]  # model layer indices; layer layers[i] uses pool slot i


@dataclass(frozen=True)
class KVLayout:
    """Which group and pool slot each layer uses."""

    groups: tuple[KVGroup, ...]
    group_size: int  # layers per block: the pool's first dimension

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1

    @property
    def windows(self) -> tuple[Optional[int], ...]:
        """Each group's window (None: full attention), in group order."""
        return tuple(g.window for g in self.groups)

    def group_of_layer(self, layer: int) -> int:
        for g, group in enumerate(self.groups):
            if layer in group.layers:
                return g
        raise ValueError(f"layer {layer} is in no KV cache group")

    def slot_of_layer(self, layer: int) -> int:
        return self.groups[self.group_of_layer(layer)].layers.index(layer)


def single_group(num_layers: int) -> KVLayout:
    """Today's layout: one table for every layer."""
    return KVLayout((KVGroup(None, tuple(range(num_layers))),), num_layers)


def kv_layout(windows: Sequence[Optional[int]], max_model_len: int, hybrid: bool = True) -> KVLayout:
    """The groups of a model whose layer l has window windows[l] (None: full attention).

    One group (single_group) unless hybrid and the model has both full-attention layers and
    layers whose window is shorter than max_model_len."""
    windows = [None if w is None or w >= max_model_len else int(w) for w in windows]
    full = [i for i, w in enumerate(windows) if w is None]
    sliding: dict[int, list[int]] = {}
    for i, w in enumerate(windows):
        if w is not None:
            sliding.setdefault(w, []).append(i)
    if not hybrid or not full or not sliding:
        return single_group(len(windows))
    size = min([len(full)] + [len(ls) for ls in sliding.values()])
    groups = [KVGroup(None, tuple(full[i:i + size])) for i in range(0, len(full), size)]
    for w in sorted(sliding):
        layers = sliding[w]
        groups.extend(KVGroup(w, tuple(layers[i:i + size])) for i in range(0, len(layers), size))
    return KVLayout(tuple(groups), size)


def window_blocks(window: int, block_size: int) -> int:
    """Most blocks a decoding sequence holds in a group of this window: those that hold the W - 1
    keys before the next query plus its own block, and one more, freed only when the next block
    opens (a decode step inside a block allocates nothing, so frees nothing)."""
    return -(-(window - 1) // block_size) + 2


def blocks_per_seq(layout: KVLayout, context: int, block_size: int) -> int:
    """Pool blocks a sequence of `context` tokens holds across all groups, decoding."""
    full = -(-context // block_size)
    return sum(full if g.window is None else min(full, window_blocks(g.window, block_size))
               for g in layout.groups)


def layer_blocks_per_seq(layout: KVLayout, context: int, block_size: int) -> int:
    """The same in layer-blocks (a block of one layer), the unit that compares layouts whose group
    sizes differ: a full-history cache holds num_layers x ceil(context / block_size)."""
    return blocks_per_seq(layout, context, block_size) * layout.group_size
