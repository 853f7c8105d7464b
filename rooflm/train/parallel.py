"""Data parallelism through PyTorch's own engine: DDP and FSDP2 (fully_shard), under torchrun.

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; the backend is NCCL on GPUs and gloo on CPUs.
Without torchrun a run is one process; --parallel fsdp then still shards over a world of
one (the same code path, so the knob table can show what FSDP's wrapping costs).

FSDP2 shards each CausalBlock (one decoder layer: the unit gathered at a time, which is
what rooflm.perf.memory counts as `fsdp_gathered`) and then the root (embedding, final
norm, LM head). With bf16/fp16 the gathered parameters are cast to the 16-bit dtype and
gradients are reduced in fp32 (MixedPrecisionPolicy), torchtitan's recipe.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: Optional[str]  # None: no process group
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU is visible to torch")
    if requested not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda; got {requested!r}")
    return torch.device(requested)


def init(parallel: str, device_request: str) -> DistInfo:
    """Join torchrun's process group (or make a world of one for --parallel without torchrun)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_request)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if world_size > 1 and parallel == "none":
        raise ValueError(f"launched with {world_size} processes: pass --parallel ddp or fsdp")
    if parallel == "none":
        return DistInfo(0, 1, 0, None, device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
        else:  # one process, no torchrun: a file store is enough for a world of one
            store = dist.FileStore(tempfile.mktemp(prefix="rooflm-train-store-"), 1)
            dist.init_process_group(backend, store=store, rank=0, world_size=1)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, backend, device)


def shutdown(clean: bool = True) -> None:
    """End the process group, if there is one. After a clean run every rank first meets at a
    barrier: a rank that tears gloo down while a peer's worker thread still talks to it aborts
    ("terminate called without an active exception"; about 1 run in 12 on a 2-core CPU)."""
    if not dist.is_initialized():
        return
    if clean:
        dist.barrier()
    dist.destroy_process_group()


def wrap(model: torch.nn.Module, parallel: str, info: DistInfo,
         param_dtype: Optional[torch.dtype]) -> torch.nn.Module:
    """The module the loop calls: the model itself, DDP around it, or the model sharded in place."""
    if parallel == "none":
        return model
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [info.device.index] if info.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def grad_sync(wrapped: torch.nn.Module, parallel: str, enabled: bool):
    """Gradient accumulation: skip the all-reduce / reduce-scatter on all but the last micro-step."""
    if parallel == "ddp" and not enabled:
        return wrapped.no_sync()
    if parallel == "fsdp":
        wrapped.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()


def mean_over_ranks(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.backend is None or info.world_size == 1:
        return value
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value / info.world_size


def max_over_ranks(value: float, info: DistInfo) -> float:
    if info.backend is None or info.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())
