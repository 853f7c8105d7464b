"""The step's token -> adapter slot map: built once per step by the model runner, read by every
LoRA hook of the model (as the attention layers read the step's AttentionMetadata).

One object per model, rewritten in place by `set_step`: the hooks hold it from installation,
as a CUDA graph holds its static inputs, so nothing per step is looked up by name or global.

Tokens are grouped by slot (Punica's SGMV): `token_order` lists the tokens that run under an
adapter, slot by slot; segment g is token_order[seg_starts[g]:seg_starts[g + 1]], all under
seg_slots[g]. Tokens without an adapter (slot -1) are in no segment: no LoRA work is done
for them. The kernels cut each segment into M tiles (kernels/lora_shrink.py slot_tiles); a step
of decodes only takes tiles of 16 and K splits fixed by the shapes (decode_only).

A CUDA graph cannot take a new grid or new segments each step, so a captured decode step runs
the mapping in its graph form (`use_graph_slots`): token_slots is a view of the graph's static
buffer [batch] int32, written before each replay (engine/cuda_graph.py); the first hook of the
step groups the rows by slot and cuts the tiles on the device (kernels/lora_shrink.py
graph_groups, one launch captured into the graph, so each replay regroups), one group per slot
of the pool, and every hook of the step reuses them (`segments`); the kernels' grid is fixed by
the batch and the slot count. Rows without an adapter and padding rows hold -1 and are in no group.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch

NO_ADAPTER = -1


class StepSegments(NamedTuple):
    """The step's tokens grouped by slot, as the kernels take them (kernels/lora_shrink.py)."""
    token_order: torch.Tensor  # int32: tokens grouped by slot
    seg_starts: torch.Tensor  # [groups + 1] int32
    seg_slots: torch.Tensor  # [groups] int32
    max_seg_len: int
    tiles: Optional[tuple[torch.Tensor, torch.Tensor]]  # (tile_group, tile_row): slot_tiles


class LoRAMapping:
    def __init__(self, device: torch.device):
        self.device = device
        self.active = False  # some token of this step runs under an adapter
        self.decode_only = False  # every sequence of the step has one query token
        self.dense = False  # a graph's step: every row is a program, its slot read on the device
        self.host_token_slots = None
        empty = torch.empty(0, dtype=torch.int32, device=device)
        self.token_slots = empty  # [T] int32: each token's slot, -1 for none
        self.token_order = empty  # [tokens under an adapter] int32, grouped by slot
        self.seg_starts = empty  # [segments + 1] int32
        self.seg_slots = empty  # [segments] int32
        self.max_seg_len = 0
        # The torch path's view of the same, (slot, token indices) per segment, built when
        # first read (the Triton path never reads it): the step's host arrays until then.
        self._groups: list[tuple[int, torch.Tensor]] = []
        self._host_segments = None
        self._segments = None  # the kernels' groups and tiles, made by the step's first hook
        self._tiles = None  # a per-step mapping's tile table (host_tiles), on the device

    def set_step(self, token_slots: Sequence[int], decode_only: bool) -> None:
        """token_slots: each packed token's slot (NO_ADAPTER for none), in the step's token order."""
        slots = np.asarray(token_slots, dtype=np.int32)
        under = np.flatnonzero(slots >= 0)
        self.dense = False
        self.active = under.size > 0
        self._groups, self._host_segments, self._segments = [], None, None
        # The step's slots on the host, for tensor parallelism's step packet (None: no adapter).
        self.host_token_slots = slots if self.active else None
        if not self.active:
            return
        self.decode_only = decode_only
        order = under[np.argsort(slots[under], kind="stable")].astype(np.int32)
        sorted_slots = slots[order]
        cuts = np.flatnonzero(np.diff(sorted_slots)) + 1
        starts = np.concatenate(([0], cuts, [order.size])).astype(np.int32)
        seg_slots = sorted_slots[starts[:-1]]
        self.max_seg_len = int(np.diff(starts).max())
        tile_group, tile_row = host_tiles(starts, self.max_seg_len, decode_only)
        # One host-to-device copy for the step's six arrays, viewed apart on the device.
        parts = (slots, order, starts, seg_slots, tile_group, tile_row)
        packed = self._to_device(np.concatenate(parts))
        views = torch.split(packed, [p.size for p in parts])
        self.token_slots, self.token_order, self.seg_starts, self.seg_slots = views[:4]
        self._tiles = (views[4], views[5])
        self._host_segments = (order, starts, seg_slots)

    @property
    def groups(self) -> list[tuple[int, torch.Tensor]]:
        if self._host_segments is not None:
            order, starts, seg_slots = self._host_segments
            self._groups = [(int(seg_slots[g]), torch.from_numpy(order[starts[g]:starts[g + 1]]).long().to(self.device))
                            for g in range(seg_slots.size)]
            self._host_segments = None
        return self._groups

    def _to_device(self, values: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(values)
        if self.device.type == "cuda":
            # From pageable memory CUDA syncs the stream before the copy: the host would wait
            # for the step in flight (async scheduling) four times a step.
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def segments(self, num_slots: int) -> "StepSegments":
        """The step's groups and M tiles for the kernels: the step's non-empty slots, or in the
        graph form every one of the pool's num_slots slots, grouped on the device (max_seg_len:
        the batch, as the graph's grid must cover any grouping); made once per step, on the
        first hook's call, and shared by every hook of the step."""
        if self._segments is None:
            from rooflm.kernels.lora_shrink import graph_groups
            if self.dense:  # one launch, captured: each replay regroups the rows it is given
                order, starts, seg_slots, tiles = graph_groups(self.token_slots, num_slots)
                self._segments = StepSegments(order, starts, seg_slots, self.token_slots.shape[0], tiles)
            else:
                self._segments = StepSegments(self.token_order, self.seg_starts, self.seg_slots, self.max_seg_len,
                                              self._tiles)
        return self._segments

    def use_graph_slots(self, token_slots: torch.Tensor) -> None:
        """The graph form of a decode step: token_slots [batch] int32 is the graph's static slot
        buffer (the view captured and replayed); nothing of it is read on the host."""
        self.active = True
        self.decode_only = True
        self.dense = True
        self.token_slots = token_slots
        self.token_order = self.seg_starts = self.seg_slots = None
        self.max_seg_len = token_slots.shape[0]
        self._groups, self._host_segments = [], None
        # Regrouped by the first hook of the forward that follows (the one a graph captures).
        self._segments = None
        self.host_token_slots = None

    def clear(self) -> None:
        self.active = False
        self.dense = False
        self.host_token_slots = None
        self._groups, self._host_segments, self._segments = [], None, None


def host_tiles(starts: np.ndarray, max_seg_len: int, decode_only: bool) -> tuple[np.ndarray, np.ndarray]:
    """A per-step mapping's tile table on the host (the same tiles kernels/lora_shrink.py
    slot_tiles makes on the device, without its padding): each segment cut into M tiles of the
    kernels' BLOCK_M, as (tile_group, tile_row) int32."""
    from rooflm.kernels.lora_shrink import block_m_for

    block_m = block_m_for(max_seg_len, decode_only)
    counts = np.diff(starts)
    tiles = (counts + block_m - 1) // block_m
    group = np.repeat(np.arange(counts.size, dtype=np.int32), tiles)
    first_tile = np.repeat(np.cumsum(tiles) - tiles, tiles)
    row = starts[group] + (np.arange(group.size) - first_tile) * block_m
    return group, row.astype(np.int32)
