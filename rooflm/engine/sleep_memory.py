"""Device memory that sleep mode can give back without moving it (vLLM's CuMemAllocator idea,
written here on ctypes calls to the CUDA driver's virtual memory management).

The decode CUDA graphs hold the addresses of every weight and of the KV pool. Freeing those
tensors at sleep and allocating new ones at wake_up moves them, and the graphs must be captured
again: seconds for an 8B model. Instead the weights and the pool live in regions: one virtual
address range reserved per region (cuMemAddressReserve), backed by physical memory mapped into
it (cuMemCreate + cuMemMap + cuMemSetAccess). Sleep unmaps and releases the physical memory
(the device gets it back); wake_up creates and maps new physical memory at the SAME virtual
addresses, so every tensor on the region, and every graph that captured it, stays valid.

- Region: the reserved range, the physical chunks mapped into it, and one uint8 tensor over it
  (a non-owning storage on the address: the region owns the memory). Chunks, not one mapping:
  the weights move in chunk by chunk, so loading with sleep mode needs one chunk above the
  weights, not twice them.
- adopt_tensors: the model's parameters and buffers moved onto a region, storage by storage
  (ties, views and strides kept: each tensor is set_ on the new storage at its old offset).
- Level 1 keeps a copy of the weights region in one pinned host buffer: one copy each way at
  the link's full rate, one synchronisation.
- CuMemDriver is the only part that talks to the driver; the tests run the rest on the CPU
  with a fake driver over host memory (a fake "unmap" scribbles the bytes, so a test that
  reads them before a wake_up fails).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Iterator, Optional, Protocol

import torch

logger = logging.getLogger(__name__)

ALIGN = 256  # bytes: every tensor moved onto a region starts at a multiple (any dtype, any kernel)
CHUNK_BYTES = 1 << 30  # weights move in through chunks of this size (rounded to the granularity)
# Chunks once nothing moves in piecemeal (the pool; the weights at wake_up): few driver calls,
# each of a size the field's allocators map routinely (vLLM's per-layer KV tensors are GBs).
WAKE_CHUNK_BYTES = 4 << 30


class Driver(Protocol):
    """What a region needs from the device's memory manager."""

    granularity: int

    def reserve(self, nbytes: int) -> int: ...
    def map(self, address: int, nbytes: int) -> object: ...  # returns the physical handle
    def unmap(self, address: int, nbytes: int, handle: object) -> None: ...
    def free(self, address: int, nbytes: int) -> None: ...
    def storage(self, address: int, nbytes: int) -> torch.UntypedStorage: ...


# ---- the CUDA driver ---------------------------------------------------------------------------


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp (cuda.h)
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_ALLOCATION_TYPE_PINNED = 1
_LOCATION_TYPE_DEVICE = 1
_ACCESS_READWRITE = 3
_GRANULARITY_RECOMMENDED = 1


class CuMemDriver:
    """cuMemAddressReserve / cuMemCreate / cuMemMap / cuMemSetAccess / cuMemUnmap / cuMemRelease /
    cuMemAddressFree through ctypes on libcuda (no compiler needed). Every call first makes the
    device's primary context (the one PyTorch's runtime uses) current on the calling thread:
    sleep and wake_up may run on another thread than the one that loaded the model, and
    torch.cuda.set_device skips the driver when the thread's device index already matches."""

    def __init__(self, device: torch.device):
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        self.lib = ctypes.CDLL("libcuda.so.1")
        u64, size_t = ctypes.c_ulonglong, ctypes.c_size_t
        for name, args in {
            "cuMemGetAllocationGranularity": [ctypes.POINTER(size_t), ctypes.POINTER(_AllocationProp), ctypes.c_int],
            "cuMemAddressReserve": [ctypes.POINTER(u64), size_t, size_t, u64, u64],
            "cuMemAddressFree": [u64, size_t],
            "cuMemCreate": [ctypes.POINTER(u64), size_t, ctypes.POINTER(_AllocationProp), u64],
            "cuMemRelease": [u64],
            "cuMemMap": [u64, size_t, size_t, u64, u64],
            "cuMemUnmap": [u64, size_t],
            "cuMemSetAccess": [u64, size_t, ctypes.POINTER(_AccessDesc), size_t],
            "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
            "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int],
            "cuCtxSetCurrent": [ctypes.c_void_p],
        }.items():
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        self.prop = _AllocationProp()
        self.prop.type = _ALLOCATION_TYPE_PINNED
        self.prop.location = _Location(_LOCATION_TYPE_DEVICE, self.device.index)
        self.access = _AccessDesc(_Location(_LOCATION_TYPE_DEVICE, self.device.index), _ACCESS_READWRITE)
        torch.cuda.init()
        ordinal = ctypes.c_int()
        self._check("cuDeviceGet", ctypes.byref(ordinal), self.device.index)
        self.context = ctypes.c_void_p()
        self._check("cuDevicePrimaryCtxRetain", ctypes.byref(self.context), ordinal.value)
        self._current()
        granularity = ctypes.c_size_t()
        self._check("cuMemGetAllocationGranularity", ctypes.byref(granularity), ctypes.byref(self.prop),
                    _GRANULARITY_RECOMMENDED)
        self.granularity = granularity.value
        self._probe()

    def _probe(self) -> None:
        """One granule reserved, mapped, unmapped and freed: a driver that refuses virtual memory
        management says so here, while the engine can still fall back, not halfway through
        moving the weights."""
        address = self.reserve(self.granularity)
        try:
            self.unmap(address, self.granularity, self.map(address, self.granularity))
        finally:
            self.free(address, self.granularity)

    def _check(self, name: str, *args) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorString(rc, ctypes.byref(text))
            raise RuntimeError(f"{name} failed on {self.device}: CUDA driver error {rc} "
                               f"({(text.value or b'?').decode()})")

    def _current(self) -> None:
        self._check("cuCtxSetCurrent", self.context)

    def reserve(self, nbytes: int) -> int:
        self._current()
        address = ctypes.c_ulonglong()
        self._check("cuMemAddressReserve", ctypes.byref(address), nbytes, self.granularity, 0, 0)
        return address.value

    def map(self, address: int, nbytes: int) -> int:
        self._current()
        handle = ctypes.c_ulonglong()
        self._check("cuMemCreate", ctypes.byref(handle), nbytes, ctypes.byref(self.prop), 0)
        try:
            self._check("cuMemMap", address, nbytes, 0, handle.value, 0)
        except RuntimeError:
            self._check("cuMemRelease", handle.value)
            raise
        self._check("cuMemSetAccess", address, nbytes, ctypes.byref(self.access), 1)
        return handle.value

    def unmap(self, address: int, nbytes: int, handle: int) -> None:
        self._current()
        self._check("cuMemUnmap", address, nbytes)
        self._check("cuMemRelease", handle)

    def free(self, address: int, nbytes: int) -> None:
        self._current()
        self._check("cuMemAddressFree", address, nbytes)

    def storage(self, address: int, nbytes: int) -> torch.UntypedStorage:
        # Non-owning: freeing the storage leaves the mapping alone (the region releases it).
        return torch._C._construct_storage_from_data_pointer(address, self.device, nbytes)


# ---- regions -----------------------------------------------------------------------------------


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class Region:
    """A reserved virtual address range with physical memory mapped into it in chunks; `data`
    is one uint8 tensor over the whole range, valid while mapped."""

    def __init__(self, driver: Driver, name: str, nbytes: int, chunk: Optional[int] = None):
        self.driver = driver
        self.name = name
        self.nbytes = round_up(max(nbytes, 1), driver.granularity)
        self.chunk = round_up(min(chunk or CHUNK_BYTES, self.nbytes), driver.granularity)
        self.address = driver.reserve(self.nbytes)
        self.handles: list[tuple[int, int, object]] = []  # (offset, nbytes, handle), in order
        self.data = torch.empty(0, dtype=torch.uint8, device=getattr(driver, "device", "cpu"))
        self.data.set_(driver.storage(self.address, self.nbytes), 0, (self.nbytes,), (1,))

    @property
    def mapped_bytes(self) -> int:
        return sum(n for _, n, _ in self.handles)

    @property
    def is_mapped(self) -> bool:
        return self.mapped_bytes == self.nbytes

    def map_through(self, end: int) -> None:
        """Physical memory under [0, end): chunks mapped as needed."""
        while self.mapped_bytes < min(end, self.nbytes):
            offset = self.mapped_bytes
            n = min(self.chunk, self.nbytes - offset)
            self.handles.append((offset, n, self.driver.map(self.address + offset, n)))

    def map_all(self) -> None:
        self.map_through(self.nbytes)

    def unmap_all(self) -> None:
        """Give the physical memory back; the addresses stay reserved (map_all again)."""
        for offset, n, handle in reversed(self.handles):
            self.driver.unmap(self.address + offset, n, handle)
        self.handles.clear()

    def close(self) -> None:
        """Unmap and give the addresses back too: every tensor on the region is dead."""
        self.unmap_all()
        self.driver.free(self.address, self.nbytes)
        self.data = None

    def tensor(self, offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor on the region at byte `offset`."""
        t = torch.empty(0, dtype=dtype, device=self.data.device)
        return t.set_(self.data.untyped_storage(), offset // t.element_size(), tuple(shape))


def module_tensors(model: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, str, str, torch.Tensor]]:
    """(owner module, "_parameters" or "_buffers", name, tensor) for every parameter and buffer,
    shared ones once per owner (a tied weight is one Parameter in two modules)."""
    for module in model.modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(module, kind).items():
                if t is not None:
                    yield module, kind, name, t


def adopt_tensors(model: torch.nn.Module, driver: Driver, name: str = "weights",
                  release=lambda: None) -> Region:
    """Move every parameter and buffer of `model` onto one new region, storage by storage: a
    storage's bytes are copied once, and each tensor on it (a tied weight, a view) is set_ on
    the new storage at its old offset, shape and strides. `release` runs before each new
    chunk is mapped (the CUDA caching allocator's empty_cache: the storages already moved are
    given back first)."""
    # Each tensor's storage address, size and offset before the move (a tied Parameter met a
    # second time is on the region already). No reference to an old storage is kept: each is
    # freed as its last tensor moves, so `release` can give it back before the next chunk.
    device = torch.device(getattr(driver, "device", "cpu"))
    entries = []
    for module, kind, attr, t in module_tensors(model):
        if t.device != device:  # a tensor kept elsewhere on purpose (host-side tables) stays there
            continue
        s = t.untyped_storage()
        entries.append((module, kind, attr, s.data_ptr(), s.nbytes(), t.storage_offset()))
    offsets: dict[int, int] = {}  # storage address -> byte offset on the region
    total = 0
    for _, _, _, key, nbytes, _ in entries:
        if key not in offsets:
            offsets[key] = total
            total += round_up(nbytes, ALIGN)
    region = Region(driver, name, total)
    moved: dict[int, torch.Tensor] = {}  # storage address -> the region's bytes that hold it now
    for module, kind, attr, key, nbytes, offset in entries:
        t = getattr(module, kind)[attr]
        if key not in moved:
            start = offsets[key]
            if region.mapped_bytes < start + nbytes:
                release()
                region.map_through(start + nbytes)
            moved[key] = region.data[start:start + nbytes]
            moved[key].copy_(torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()))
        new = torch.empty(0, dtype=t.dtype, device=region.data.device).set_(
            moved[key].untyped_storage(), offsets[key] // t.element_size() + offset, t.size(), t.stride())
        if kind == "_parameters":
            t.data = new  # the Parameter object (and any tie to it) stays
        else:
            module._buffers[attr] = new
        del t
    region.chunk = round_up(min(WAKE_CHUNK_BYTES, region.nbytes), driver.granularity)  # moved in
    return region


def host_backup(nbytes: int, device: torch.device) -> torch.Tensor:
    """The host buffer level 1 keeps the weights in: pinned when the device is a GPU (a copy
    from pageable memory runs at a fraction of the link's rate and blocks the host)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")


# ---- which addresses the graphs hold ---------------------------------------------------------


def tensor_addresses(model: Optional[torch.nn.Module], kv_caches) -> dict[str, int]:
    """The device address of everything a captured step reads that sleep could move: each
    parameter and buffer, each layer's K and V pools and their scales."""
    out: dict[str, int] = {}
    if model is not None:
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            out[name] = t.data_ptr()
    for i, cache in enumerate(kv_caches or ()):
        if cache is None:
            continue
        for field in ("k", "v", "k_scale", "v_scale"):
            t = getattr(cache, field, None)
            if t is not None:
                out[f"kv_caches[{i}].{field}"] = t.data_ptr()
    return out


def stale_addresses(captured: dict[str, int], now: dict[str, int]) -> list[str]:
    """Names whose address changed since capture (or that appeared or went): a graph replayed
    on them would read freed memory."""
    return sorted(name for name in captured.keys() | now.keys() if captured.get(name) != now.get(name))


@dataclass(frozen=True)
class WakePhases:
    """Where a wake_up's time went (seconds); `graphs` says what happened to the CUDA graphs:
    "kept" (every captured address unchanged), "captured" (again), or "none" (eager)."""

    weights_s: float
    kv_s: float
    graphs_s: float
    total_s: float
    graphs: str
    weights: str  # "copied" (level 1 from host), "loaded" (level 2), "kept" (the CPU)

    def line(self, level: int) -> str:
        return (f"wake_up from level {level}: weights {self.weights_s:.2f} s ({self.weights}), "
                f"kv {self.kv_s:.2f} s, graphs {self.graphs_s:.2f} s ({self.graphs}), total {self.total_s:.2f} s")

    def as_dict(self) -> dict:
        return {"weights_s": self.weights_s, "kv_s": self.kv_s, "graphs_s": self.graphs_s,
                "total_s": self.total_s, "graphs": self.graphs, "weights": self.weights}
