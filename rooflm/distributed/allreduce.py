"""The row-parallel layers' all-reduce on CUDA: NCCL, or a one-shot kernel over symmetric memory.

At batch 1 a Llama-3-8B decode step of TP=2 sends 65 all-reduces of 8 KiB; their time is the
collective's fixed cost, not bandwidth, and NCCL's ring pays several microseconds of protocol per
call. A one-shot all-reduce over symmetric memory (PyTorch's torch.distributed._symmetric_memory,
the mechanism of vLLM's custom all-reduce and SymmMemCommunicator) is one kernel: each rank copies
its input into a buffer every peer has mapped (CUDA IPC), the ranks meet at a flag in a signal
pad, and each rank reads all peers' buffers over NVLink and sums them itself. Its cost grows
with N x bytes read per rank, so it wins for small messages and loses to NCCL's ring for large
ones: messages up to SYMM_MAX_BYTES take it, larger ones (prefill chunks) take NCCL.

Algorithm and bytes, per rank, for a message of B bytes over N ranks:
  one-shot: write B to the own buffer, read (N - 1) x B from peers, write B out; 2 flag waits.
  NCCL ring: 2 (N - 1) / N x B sent and received, 2 (N - 1) steps of latency.
The kernel is torch.ops.symm_mem.one_shot_all_reduce_copy_out (torch >= 2.8; the copy into the
symmetric buffer is fused in), bf16 and fp32 only: other dtypes take NCCL. It launches on the
current stream with fixed buffer addresses, so CUDA graphs capture it like any kernel. It needs
peer access between every pair of GPUs (NVLink or PCIe P2P): "auto" checks that with
torch.cuda.can_device_access_peer. NVLink multicast stays off (TORCH_SYMM_MEM_DISABLE_MULTICAST:
the GPU hosts here forbid it, like NCCL_NVLS_ENABLE=0); the one-shot kernel does not use it.

Every rank must take the same path for each message (they would otherwise wait in different
collectives), so the choice is agreed over the host group at start (peer access, the op, the
buffer, the rendezvous, then a probe sum that must equal NCCL's: "auto" falls back to NCCL if
any fails on any rank), and the size test depends only on the message's shape and dtype, the
same on every rank. `reference_all_reduce` is what both paths compute, for the checks.

The rendezvous is set up once per group and bounded. torch exchanges the buffers' handles
through the group's store under keys numbered by a counter that lives in each process, not in
the group: a process that already joined one group's rendezvous (rank 0 of a second engine in
the same process, e.g. a test that builds TP=2 twice) numbers its keys ahead of freshly
started workers, and torch then waits the store's whole timeout (180 s) for keys nobody writes
("wait timeout after 180000ms, keys: /0//CUDASymmetricMemory/2/1"). So every rank first says
how many rendezvous its process has joined; unless all agree, the group uses NCCL with a
warning ("symm" mode refuses, naming why). The rendezvous itself runs under a store timeout of
RENDEZVOUS_TIMEOUT_S, so anything else that stalls it falls back too instead of waiting.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

MODES = ("auto", "nccl", "symm")
# Above this NCCL's ring is expected to win (vLLM's SymmMemCommunicator allows 8 MiB at TP=2);
# benchmarks/allreduce.py measures where the crossover really is.
SYMM_MAX_BYTES = 4 << 20
SYMM_DTYPES = (torch.bfloat16, torch.float32)  # the kernel's dispatch
# The most the symmetric-memory rendezvous may wait on its peers' handles (it takes milliseconds).
RENDEZVOUS_TIMEOUT_S = 20.0


def symm_op_available() -> bool:
    """Whether this torch build has the one-shot symmetric-memory all-reduce."""
    try:
        import torch.distributed._symmetric_memory  # noqa: F401 - registers the ops' Python side
        torch.ops.symm_mem.one_shot_all_reduce_copy_out  # noqa: B018 - raises when the op is missing
        torch.ops.symm_mem.one_shot_all_reduce_out  # noqa: B018
    except (ImportError, AttributeError, RuntimeError):
        return False
    return True


def peer_access(size: int) -> tuple[bool, str]:
    """Whether GPUs 0..size-1 of this host can all read each other's memory, and why not."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", size))
    if local != size:
        return False, f"the {size} ranks span several hosts ({local} on this one)"
    if not torch.cuda.is_available() or torch.cuda.device_count() < size:
        return False, f"fewer than {size} visible GPUs"
    for i in range(size):
        for j in range(size):
            if i != j and not torch.cuda.can_device_access_peer(i, j):
                return False, f"GPU {i} cannot access GPU {j}'s memory (no P2P: NCCL goes through the host)"
    return True, ""


class SymmAllReduce:
    """A symmetric buffer of max_bytes on every rank, and the one-shot all-reduce over it."""

    # Rendezvous this process has joined, as torch's own per-process key counter sees them
    # (module docstring); None once one failed part way: the counter's value is then unknown.
    # Per process by nature, as torch's counter is.
    rendezvous_joined: Optional[int] = 0

    def __init__(self, buffer: torch.Tensor, group: dist.ProcessGroup):
        import torch.distributed._symmetric_memory as symm_mem
        self.buffer = buffer  # uint8 [max_bytes], viewed as each message's dtype
        self.max_bytes = buffer.numel()
        self.group_name = group.group_name
        joined = SymmAllReduce.rendezvous_joined
        SymmAllReduce.rendezvous_joined = None  # until it returns
        with _store_timeout(group, RENDEZVOUS_TIMEOUT_S):
            self.handle = symm_mem.rendezvous(buffer, group.group_name)  # collective: maps the peers' buffers
        SymmAllReduce.rendezvous_joined = None if joined is None else joined + 1

    @staticmethod
    def allocate(max_bytes: int, device: torch.device) -> torch.Tensor:
        import torch.distributed._symmetric_memory as symm_mem
        return symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)

    def fits(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        # The kernel moves 4-, 8- or 16-byte vectors: the size must be a multiple of 4.
        return (x.dtype in SYMM_DTYPES and x.is_contiguous() and 0 < nbytes <= self.max_bytes
                and nbytes % 4 == 0)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (x must fit)."""
        flat = x.view(-1)
        symm = self.buffer[:flat.numel() * flat.element_size()].view(x.dtype)
        if x.storage_offset() == 0:
            # One kernel copies x into the buffer and reduces; the op wants the same alignment
            # for both, which equal sizes at offset 0 give. Writing the sum over x is safe:
            # each thread reads its elements of x before the ranks' barrier, writes after.
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(symm, flat, "sum", self.group_name, flat)
        else:
            symm.copy_(flat)
            torch.ops.symm_mem.one_shot_all_reduce_out(symm, "sum", self.group_name, flat)
        return x


def make_symm_all_reduce(mode: str, size: int, device: torch.device, device_group, host_group,
                         max_bytes: int = SYMM_MAX_BYTES) -> Optional[SymmAllReduce]:
    """The symmetric-memory all-reduce the mode asks for, or None for NCCL / gloo throughout.
    Collective: every rank calls it, in the same order, right after the groups start."""
    if mode not in MODES:
        raise ValueError(f"tp_allreduce must be one of {', '.join(MODES)}; got {mode!r}")
    if device.type != "cuda":
        if mode == "symm":
            logger.warning("--tp-allreduce symm needs CUDA GPUs; on %s the all-reduces run on gloo",
                           device.type)
        return None
    if mode == "nccl" or size == 1:
        return None
    ok, why = peer_access(size)
    if ok and not symm_op_available():
        ok, why = False, f"torch {torch.__version__} lacks torch.ops.symm_mem.one_shot_all_reduce_copy_out"
    buffer = None
    if ok:
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
        try:  # local: a failure here must reach the vote below, not strand the peers
            buffer = SymmAllReduce.allocate(max_bytes, device)
        except RuntimeError as exc:
            ok, why = False, f"symmetric memory allocation failed: {exc}"
    # Collective on every rank (whatever it found so far), so the ranks stay in step.
    same_count, count_why = _same_rendezvous_count(host_group)
    if ok and not same_count:
        ok, why = False, count_why
    # Votes over the host group: every rank takes symm or none does.
    ok, why = _agree(ok, why, host_group)
    symm = None
    if ok:
        try:  # collective; a failure on every rank (a driver without the mapping) is voted on below
            symm = SymmAllReduce(buffer, device_group)
        except RuntimeError as exc:
            ok, why = False, f"symmetric-memory rendezvous failed: {exc}"
        ok, why = _agree(ok, why, host_group)
    if ok:
        ok, why = _agree(*_probe(symm, device_group, device), host_group)
    if not ok:
        if mode == "symm":
            raise ValueError(f"--tp-allreduce symm cannot run here: {why}; use --tp-allreduce nccl "
                             f"(or auto, which falls back)")
        logger.warning("tp all-reduce: NCCL (symmetric memory unavailable: %s)", why)
        return None
    logger.info("tp all-reduce: one-shot over symmetric memory up to %d KiB, NCCL above", max_bytes >> 10)
    return symm


def _same_rendezvous_count(host_group) -> tuple[bool, str]:
    """Whether every rank's process has joined as many rendezvous (module docstring). Collective
    over the host group; every rank gets the same answer."""
    joined = SymmAllReduce.rendezvous_joined
    mine = torch.tensor([-1 if joined is None else joined], dtype=torch.int64)
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(host_group))]
    dist.all_gather(counts, mine, group=host_group)
    counts = [int(c.item()) for c in counts]
    if min(counts) >= 0 and min(counts) == max(counts):
        return True, ""
    return False, (f"the ranks' processes have joined different numbers of symmetric-memory "
                   f"rendezvous ({counts}; -1: one failed part way): torch numbers the rendezvous's "
                   f"store keys per process, so they would wait for each other's keys (a second "
                   f"engine in a process that ran one before: start it in a fresh process for symm)")


class _store_timeout:
    """The group's store waits at most seconds while inside (torch's rendezvous waits on it)."""

    def __init__(self, group, seconds: float):
        self.store = None
        try:
            self.store = dist.distributed_c10d._get_process_group_store(group)
        except (AttributeError, RuntimeError, ValueError):  # a torch without it: unbounded, as before
            logger.debug("no store handle for the symmetric-memory rendezvous timeout")
        self.timeout = datetime.timedelta(seconds=seconds)

    def __enter__(self):
        if self.store is not None:
            self.saved = self.store.timeout
            self.store.set_timeout(self.timeout)
        return self

    def __exit__(self, *exc) -> None:
        if self.store is not None:
            self.store.set_timeout(self.saved)


def _agree(ok: bool, why: str, host_group) -> tuple[bool, str]:
    vote = torch.tensor([1 if ok else 0], dtype=torch.int64)
    dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=host_group)
    if vote.item():
        return True, ""
    return False, why or "another rank cannot use it"


def _probe(symm: SymmAllReduce, device_group, device: torch.device) -> tuple[bool, str]:
    """One small all-reduce both ways: the kernel must give NCCL's sum (exact: small integers
    in fp32) before the engine trusts it with every layer."""
    rank = dist.get_rank(device_group)
    probe = torch.arange(1, 257, dtype=torch.float32, device=device) * (rank + 1)
    expected = probe.clone()
    dist.all_reduce(expected, group=device_group)
    symm.all_reduce(probe)
    torch.cuda.synchronize(device)
    if not torch.equal(probe, expected):
        return False, "the one-shot kernel's probe sum differs from NCCL's"
    return True, ""


def reference_all_reduce(parts: list[torch.Tensor]) -> torch.Tensor:
    """What every rank holds after the all-reduce of its part: the sum, in fp32 then cast back."""
    return torch.stack([p.float() for p in parts]).sum(0).to(parts[0].dtype)
