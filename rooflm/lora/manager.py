"""Adapters from disk to a device slot: the host cache (--max-cpu-loras, LRU) and the device
slot pool (--max-loras, LRU among the adapters the step does not use).

The scheduler lets no step use more distinct adapters than there are slots
(Scheduler.max_loras), so `activate` always finds room. An adapter the host cache evicted is
read from disk again when a request needs it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Iterable

from rooflm.config import LoRAConfig, ModelConfig
from rooflm.lora.adapter import PROJECTIONS, LoRAAdapter, load_adapter
from rooflm.lora.hook import LoRALinearHook
from rooflm.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model_config: ModelConfig, config: LoRAConfig,
                 hooks: dict[tuple[int, str], LoRALinearHook]):
        self.model_config = model_config
        self.config = config
        self.hooks = hooks
        self.host: OrderedDict[LoRARequest, LoRAAdapter] = OrderedDict()  # least recently used first
        self.resident: OrderedDict[LoRARequest, int] = OrderedDict()  # adapter -> slot, LRU first
        self.free_slots = list(range(config.max_loras))
        self.num_disk_loads = 0

    def load(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter in host memory: from the cache, else read and checked (LoRAAdapterError)."""
        adapter = self.host.get(request)
        if adapter is not None:
            self.host.move_to_end(request)
            return adapter
        adapter = load_adapter(request.lora_name, request.lora_path, self.model_config, self.config.max_lora_rank)
        self.num_disk_loads += 1
        self.host[request] = adapter
        while len(self.host) > self.config.host_cache_size:
            self.host.popitem(last=False)
        return adapter

    def activate(self, requests: Iterable[LoRARequest]) -> dict[LoRARequest, int]:
        """Slots for the step's adapters: resident ones stay, others take a free slot or the
        least recently used slot of an adapter this step does not use."""
        needed = list(dict.fromkeys(requests))
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
            self._write(slot, self.load(request))
            self.resident[request] = slot
            slots[request] = slot
        return slots

    def _evict(self, keep: set) -> int:
        victim = next(r for r in self.resident if r not in keep)
        return self.resident.pop(victim)

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        for hook in self.hooks.values():
            hook.clear_slot(slot)
        for (layer, projection), (a, b) in adapter.weights.items():
            linear, shard = PROJECTIONS[projection]
            self.hooks[(layer, linear)].write(slot, shard, a, b, adapter.scaling)

    def remove(self, request: LoRARequest) -> None:
        """Forget an adapter (unloaded): its host copy and its slot."""
        self.host.pop(request, None)
        slot = self.resident.pop(request, None)
        if slot is not None:
            self.free_slots.append(slot)
