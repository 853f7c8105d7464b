"""A process's place in a tensor-parallel group, and the collectives the layers use.

Two process groups: the device group (NCCL on CUDA, gloo on the CPU) carries the layers'
all-reduces and all-gathers and the sampled token ids; the host group (always gloo) carries
each step's metadata from rank 0 (step_broadcast.py), so that the workers copy it to their
own device the way rank 0 does, and nothing of the step's description waits on a device.

NVLink multicast (NVLS) stays off: NCCL_NVLS_ENABLE=0 is set before NCCL starts, since
the GPU hosts here forbid it (and NCCL would otherwise try it on NVSwitch systems).
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# A step's device collectives wait on their peers for at most this long before they raise,
# so that a rank that hangs (rather than dies: the executor sees deaths at once) cannot hang
# the engine. The host group waits far longer: a worker waits there for the next step, and
# a server may sit idle for hours. (On the CPU both are one gloo group: the long timeout.)
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)
IDLE_TIMEOUT = datetime.timedelta(days=30)
# Every rank must have joined by then: a worker that fails before joining fails the start.
STARTUP_TIMEOUT = datetime.timedelta(minutes=3)
# Leaving the group (barrier + destroy) is abandoned after this long: see destroy_group.
DESTROY_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank holds. Query heads split evenly; KV heads split evenly
    when there are at least as many as ranks, else each rank holds the one KV head its
    query heads read (GQA/MQA with fewer KV heads than ranks: replicated)."""

    num_heads: int
    num_kv_heads: int
    first_head: int
    first_kv_head: int


class TPGroup:
    """Rank and size, plus the collectives; size 1 makes every collective a no-op."""

    def __init__(self, rank: int = 0, size: int = 1, device_group=None, host_group=None, symm=None,
                 root: int = 0):
        self.rank = rank
        self.size = size
        self.device_group = device_group
        self.host_group = host_group
        self.symm = symm  # allreduce.SymmAllReduce: small all-reduces over symmetric memory, or None
        # The global rank of this group's rank 0, the source of its broadcasts: 0 for the whole
        # world, stage * TP for a pipeline stage's TP group (distributed/pipeline.py).
        self.root = root

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def heads(self, num_heads: int, num_kv_heads: int) -> HeadShard:
        check_divisible(num_heads, num_kv_heads, self.size)
        kv_per_rank = max(1, num_kv_heads // self.size)
        heads_per_rank = num_heads // self.size
        return HeadShard(heads_per_rank, kv_per_rank, self.rank * heads_per_rank,
                         self.rank * num_kv_heads // self.size)

    def split(self, total: int) -> tuple[int, int]:
        """(start, size) of this rank's even share of `total` rows (total divisible by size)."""
        share = total // self.size
        return self.rank * share, share

    def padded_split(self, total: int) -> tuple[int, int, int]:
        """(start, size held, size allocated) of a dimension split in ceil(total / N) pieces:
        the vocabulary, which no tokenizer sizes for the rank count. The last rank's piece
        may be short; its allocated rows past the end stay zero."""
        share = -(-total // self.size)
        start = min(self.rank * share, total)
        return start, min(share, total - start), share

    # ---- collectives ------------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place. The path depends only on x's shape and dtype, which
        every rank shares, so all ranks always meet in the same collective."""
        if self.size > 1:
            if self.symm is not None and self.symm.fits(x):
                return self.symm.all_reduce(x)
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n], rank r's piece at r * n."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = torch.empty((self.size,) + tuple(x.shape), dtype=x.dtype, device=x.device)
        if x.device.type == "cuda":
            dist.all_gather_into_tensor(parts, x, group=self.device_group)
        else:  # gloo gathers into a list
            dist.all_gather(list(parts.unbind(0)), x, group=self.device_group)
        return parts.movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])

    def broadcast_device(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x into every rank's x (same shape and dtype), on the device group."""
        if self.size > 1:
            dist.broadcast(x, src=self.root, group=self.device_group)
        return x

    def broadcast_host(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.broadcast(x, src=self.root, group=self.host_group)
        return x

    def broadcast_host_async(self, x: torch.Tensor):
        """Rank 0's x to the other ranks without waiting: the Work handle, or None (one rank).
        x must stay alive and unchanged until the handle's wait() returns."""
        if self.size > 1:
            return dist.broadcast(x, src=self.root, group=self.host_group, async_op=True)
        return None

    def min_over_ranks(self, value: int) -> int:
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.host_group)
        return int(t.item())


SINGLE = TPGroup()


def check_divisible(num_heads: int, num_kv_heads: int, size: int) -> None:
    """The shapes tensor parallelism of `size` ranks can split, with the reason when not."""
    if num_heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's "
                         f"{num_heads} attention heads")
    if num_kv_heads >= size and num_kv_heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's "
                         f"{num_kv_heads} KV heads")
    if num_kv_heads < size and size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size {size} is not a multiple of the model's "
                         f"{num_kv_heads} KV heads (each rank must hold whole KV heads)")


def init_group(rank: int, size: int, init_method: str, device: torch.device,
               allreduce: str = "auto") -> TPGroup:
    """Join the group (blocks until every rank has). allreduce: ParallelConfig.tp_allreduce."""
    from rooflm.distributed.allreduce import make_symm_all_reduce
    device_group, host_group = start_world(rank, size, init_method, device)
    symm = make_symm_all_reduce(allreduce, size, device, device_group, host_group)
    return TPGroup(rank, size, device_group, host_group, symm)


def start_world(rank: int, size: int, init_method: str, device: torch.device) -> tuple:
    """Join the default process group; (device group, host group) over every rank (one gloo
    group for both on the CPU)."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    if init_method.startswith("tcp://"):  # our own store: its timeout bounds the rendezvous only
        host, port = init_method[len("tcp://"):].rsplit(":", 1)
        kwargs["store"] = dist.TCPStore(host, int(port), size, rank == 0, timeout=STARTUP_TIMEOUT)
    else:
        kwargs["init_method"] = init_method
    dist.init_process_group(backend, rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT if backend == "nccl" else IDLE_TIMEOUT, **kwargs)
    device_group = dist.group.WORLD
    host_group = new_subgroup(None, "gloo", IDLE_TIMEOUT) if backend == "nccl" else device_group
    return device_group, host_group


def new_subgroup(ranks: Optional[list[int]], backend: Optional[str], timeout: datetime.timedelta):
    """dist.new_group: every rank of the world must call it, in the same order, for every group."""
    return dist.new_group(ranks, backend=backend, timeout=timeout)


def destroy_group(group: TPGroup, clean: bool = True, timeout_s: Optional[float] = None) -> bool:
    """Leave the group; False when it did not finish in timeout_s (DESTROY_TIMEOUT_S).

    After a clean run every rank first meets at a barrier (a rank that tears gloo down while a
    peer still talks to it can abort: rooflm/train/parallel.py::shutdown). Callers release their
    CUDA graphs first (ModelRunner.release_graphs): NCCL waits for graphs that captured its
    collectives. Should NCCL wait anyway, the work runs on a daemon thread and is abandoned
    after the timeout, so that a stuck teardown cannot hang the process's exit."""
    if group.size == 1 or not dist.is_initialized():
        return True
    group.symm = None  # the symmetric buffer's mapping goes before the group it was made over
    failure: list[BaseException] = []

    def leave() -> None:
        try:
            if clean:
                dist.barrier(group=group.host_group)
            dist.destroy_process_group()
        except BaseException as exc:  # noqa: BLE001 - re-raised by the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=leave, name="rooflm-tp-destroy", daemon=True)
    thread.start()
    thread.join(DESTROY_TIMEOUT_S if timeout_s is None else timeout_s)
    if thread.is_alive():
        logger.warning("tensor-parallel rank %d: leaving the process group did not finish in %.0f s; "
                       "abandoned (set ROOFLM_HANG_DUMP_S to see where it waits)", group.rank,
                       DESTROY_TIMEOUT_S if timeout_s is None else timeout_s)
        return False
    if failure:
        raise failure[0]
    return True


def abort_group(timeout_s: Optional[float] = None) -> None:
    """Make collectives blocked on a dead peer return with an error (NCCL would wait for the
    timeout); best effort, as the call is private to torch, and bounded like destroy_group:
    an abort that itself waits on NCCL is abandoned on its daemon thread."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None or not dist.is_initialized():
        return

    def run() -> None:
        try:
            abort()
        except Exception:  # noqa: BLE001 - the group is broken either way
            pass

    thread = threading.Thread(target=run, name="rooflm-tp-abort", daemon=True)
    thread.start()
    thread.join(DESTROY_TIMEOUT_S if timeout_s is None else timeout_s)
    if thread.is_alive():
        logger.warning("aborting the tensor-parallel group did not finish in %.0f s; abandoned",
                       DESTROY_TIMEOUT_S if timeout_s is None else timeout_s)


def visible_devices(device: torch.device) -> Optional[int]:
    """How many devices of this type ranks could use (None on the CPU: no limit)."""
    if device.type == "cuda":
        return torch.cuda.device_count()
    return None
