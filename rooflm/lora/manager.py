"""Adapters from disk to a device slot: the host cache (--max-cpu-loras, LRU) and the device
slot pool (--max-loras, LRU among the adapters the step does not use).

An adapter in the host cache is kept as its image in the slot layout (rooflm/lora/hook.py's
pool row: every hook's A and B, zero-padded to the slot rank, B scaled, in the model's dtype,
in pinned memory on CUDA), built once when it is read from disk: the file's tensors are views
of its mapping (adapter.py map_safetensors), each copied once into the image (B scaled in the
same pass), zeros written only where the adapter leaves elements unwritten. Making it resident is then one
host-to-device copy of that row (~84 MB for rank 16 on all seven projections of an 8B model:
a few milliseconds), not a copy per projection and layer.

The scheduler lets no step use more distinct adapters than there are slots
(Scheduler.max_loras), so `activate` always finds room. An adapter the host cache evicted is
read from disk again when a request needs it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Iterable

import torch

from rooflm.config import LoRAConfig, ModelConfig
from rooflm.lora.adapter import PROJECTIONS, LoRAAdapter, load_adapter
from rooflm.lora.hook import LoRALinearHook
from rooflm.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model_config: ModelConfig, config: LoRAConfig,
                 hooks: dict[tuple[int, str], LoRALinearHook], pool: torch.Tensor):
        self.model_config = model_config
        self.config = config
        self.hooks = hooks
        self.pool = pool  # [slots, elements]: slot s is row s (install_lora)
        self.host: OrderedDict[LoRARequest, torch.Tensor] = OrderedDict()  # slot images, LRU first
        self.resident: OrderedDict[LoRARequest, int] = OrderedDict()  # adapter -> slot, LRU first
        self.free_slots = list(range(config.max_loras))
        self.num_disk_loads = 0
        # The (slot, adapter) writes of the last activate: tensor parallelism's workers make
        # the same writes (write_slot), so every rank's slot s holds the same adapter.
        self.step_writes: list[tuple[int, LoRARequest]] = []

    def load(self, request: LoRARequest) -> torch.Tensor:
        """The adapter's slot image in host memory: from the cache, else read, checked
        (LoRAAdapterError) and laid out."""
        image = self.host.get(request)
        if image is not None:
            self.host.move_to_end(request)
            return image
        start = time.perf_counter()
        adapter = load_adapter(request.lora_name, request.lora_path, self.model_config, self.config.max_lora_rank)
        read = time.perf_counter()
        image = self.slot_image(adapter)
        logger.debug("LoRA adapter %s from disk: mapped and checked in %.1f ms, slot image (%.0f MB) in %.1f ms",
                     request.lora_name, 1e3 * (read - start), image.numel() * image.element_size() / 1e6,
                     1e3 * (time.perf_counter() - read))
        self.num_disk_loads += 1
        self.host[request] = image
        while len(self.host) > self.config.host_cache_size:
            self.host.popitem(last=False)
        return image

    def slot_image(self, adapter: LoRAAdapter) -> torch.Tensor:
        """An adapter as one slot's row of the pool: every hook's A and B in place, zeros where
        it has no target or a lower rank. One pass over the adapter's bytes (B scaled as it is
        copied), and zeros written only where nothing else is: an 8B model's image is ~84 MB,
        and each pass over it is milliseconds of the cold load."""
        pinned = self.pool.device.type == "cuda"
        image = torch.empty(self.pool.shape[1], dtype=self.pool.dtype, pin_memory=pinned)
        by_hook: dict[tuple[int, str], list] = {key: [] for key in self.hooks}
        for (layer, projection), (a, b) in adapter.weights.items():
            linear, shard = PROJECTIONS[projection]
            by_hook[(layer, linear)].append((shard, a, b))
        for key, hook in self.hooks.items():
            views = hook.slot_views(image)
            writes = by_hook[key]
            if not hook.covered_by({shard for shard, _, _ in writes}, adapter.rank):
                for view in views:
                    view.zero_()
            for shard, a, b in writes:
                hook.write_into(*views, shard, a, b, adapter.scaling)
        return image

    def activate(self, requests: Iterable[LoRARequest]) -> dict[LoRARequest, int]:
        """Slots for the step's adapters: resident ones stay, others take a free slot or the
        least recently used slot of an adapter this step does not use."""
        needed = list(dict.fromkeys(requests))
        self.step_writes = []
        if len(needed) > self.config.max_loras:
            raise RuntimeError(f"a step uses {len(needed)} LoRA adapters but there are {self.config.max_loras} "
                               f"slots (the scheduler should have kept it to --max-loras)")
        slots = {}
        for request in needed:
            if request in self.resident:
                self.resident.move_to_end(request)
                slots[request] = self.resident[request]
        for request in needed:
            if request in slots:
                continue
            slot = self.free_slots.pop() if self.free_slots else self._evict(set(slots))
            # Pinned host memory: the copy is queued on the step's stream before its forward.
            self.pool[slot].copy_(self.load(request), non_blocking=True)
            self.resident[request] = slot
            slots[request] = slot
            self.step_writes.append((slot, request))
        return slots

    def write_slot(self, slot: int, request: LoRARequest) -> None:
        """Put `request` in slot `slot` as rank 0 decided (a tensor-parallel worker's side of
        activate): whatever held the slot leaves it."""
        for held, at in list(self.resident.items()):
            if at == slot:
                del self.resident[held]
        if slot in self.free_slots:
            self.free_slots.remove(slot)
        self.pool[slot].copy_(self.load(request), non_blocking=True)
        self.resident[request] = slot

    def _evict(self, keep: set) -> int:
        victim = next(r for r in self.resident if r not in keep)
        return self.resident.pop(victim)

    def remove(self, request: LoRARequest) -> None:
        """Forget an adapter (unloaded): its host copy and its slot."""
        self.host.pop(request, None)
        slot = self.resident.pop(request, None)
        if slot is not None:
            self.free_slots.append(slot)
