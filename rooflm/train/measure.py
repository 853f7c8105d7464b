"""What a training run achieved against the hardware: FLOPs, MFU, memory, time breakdown, verdict.

FLOPs are the model's (rooflm.perf.roofline.step_cost of a forward over every token,
LM head on every token, causal attention counted as the half it computes), times 3
for forward + backward (the backward computes two matmuls per forward one). Recompute
under activation checkpointing is not counted: MFU is the work the model needs, so
checkpointing shows up as the MFU it costs.

The rate is the device's measured matmul rate (rooflm.perf.gpus.measure_gpu on CUDA, a
timed fp32 matmul on the CPU) or a named GPU from the table.

The breakdown profiles one step with torch.profiler and sorts device time into matmul,
attention, communication and everything else (element-wise, norms, optimizer,
copies: memory-bound work); the time no kernel ran is the host's (Python, launches,
data loading). The verdict names the largest.
"""

from __future__ import annotations

import functools
import resource
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from rooflm.config import ModelConfig
from rooflm.perf.memory import training_memory
from rooflm.perf.roofline import ATTENTION, MATMUL, causal_pairs, step_cost


def train_flops_per_sequence(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of one training sequence: 3 x (matmuls + attention of its forward)."""
    cost = step_cost(cfg, prefill_tokens=seq_len,
                     prefill_attention_pairs=causal_pairs(seq_len, 0, cfg.sliding_window),
                     num_sampled_prefills=seq_len)  # the LM head runs on every token
    forward = sum(op.flops for op in cost.ops if op.kind in (MATMUL, ATTENTION))
    return 3.0 * forward


@functools.lru_cache(maxsize=None)
def cpu_matmul_rate(n: int = 1024, repeats: int = 8) -> float:
    """FLOP/s of an fp32 n^3 matmul on this CPU, the best of `repeats`: the roof is the fastest
    the CPU went (a shared CPU's slower runs are other processes' doing)."""
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


@dataclass(frozen=True)
class Roof:
    flops: float  # FLOP/s the MFU is measured against
    source: str


def device_roof(device: torch.device, peak_format: str, gpu: Optional[str]) -> Roof:
    """The matmul rate of this device in the run's precision: measured unless a GPU is named."""
    if device.type == "cpu":
        return Roof(cpu_matmul_rate(), "measured: fp32 1024^3 matmul on this CPU")
    from rooflm.perf.gpus import get_gpu, measure_gpu

    spec = get_gpu(gpu) if gpu else measure_gpu(device=str(device))
    return Roof(spec.peak_flops(peak_format), f"{spec.name} {peak_format} ({spec.source})")


# ---- memory ------------------------------------------------------------------------------

def predicted_memory(cfg: ModelConfig, seq_len: int, micro_batch: int, memory_dtype: str,
                     parallel: str, world_size: int, checkpointing: str) -> float:
    """rooflm memory --train's bytes per GPU for this run."""
    mem = training_memory(cfg, num_gpus=world_size, micro_batch=micro_batch, seq_len=seq_len,
                          dtype=memory_dtype, flash_attention=True)
    return mem.fsdp_per_gpu(checkpointing) if parallel == "fsdp" else mem.ddp_per_gpu(checkpointing)


def recipe_extra_bytes(cfg: ModelConfig, precision: str, parallel: str) -> float:
    """What this lab's recipe holds beyond rooflm memory --train's ZeRO accounting (bf16 weights,
    bf16 grads, fp32 master, Adam = 16 B/param): under autocast without FSDP the 16-bit weights
    are autocast's cached casts (the same 2 B/param) but the gradients land on the fp32
    parameters, 4 B/param instead of 2. FSDP's mixed-precision policy reduces into fp32 shards,
    which the accounting already counts as its 16 B/param / N."""
    if precision in ("bf16", "fp16", "fp8") and parallel != "fsdp":
        return 2.0 * cfg.num_params()
    return 0.0


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> tuple[float, str]:
    """(bytes, what was measured): allocated tensors on CUDA, the process's peak RSS on a CPU."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device)), "torch.cuda.max_memory_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0, "process peak RSS"


# ---- step-time breakdown -----------------------------------------------------------------

@dataclass
class PhaseTimes:
    """Seconds per optimizer step, from timers around each phase (events on CUDA)."""

    data: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
    optimizer: float = 0.0


_COMM = ("nccl", "gloo", "c10d::", "all_reduce", "allreduce", "reduce_scatter", "all_gather",
         "allgather", "broadcast")
_ATTENTION = ("flash", "fmha", "attention", "sdpa", "cudnn_", "scaled_dot_product")
_MATMUL_CUDA = ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "matmul", "splitk")
_MATMUL_CPU = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_weight_int", "mkl", "onednn")


def classify(name: str, on_cuda: bool) -> str:
    lowered = name.lower()
    if any(t in lowered for t in _COMM):
        return "communication"
    if any(t in lowered for t in _ATTENTION):
        return "attention"
    if any(t in lowered for t in (_MATMUL_CUDA if on_cuda else _MATMUL_CPU)):
        return "matmul"
    return "other"


def kernel_breakdown(prof, on_cuda: bool) -> dict[str, float]:
    """Seconds of device time (CPU: self time of aten ops) by category, from one profiled step.

    On CUDA only the kernels themselves count: a CPU op's device time is its kernels' again."""
    from torch.autograd import DeviceType

    totals = {"matmul": 0.0, "attention": 0.0, "communication": 0.0, "other": 0.0}
    for evt in prof.key_averages():
        if on_cuda:
            if evt.device_type != DeviceType.CUDA:
                continue
            us = evt.self_device_time_total
        else:
            if not evt.key.startswith(("aten::", "c10d::", "gloo", "mkl")):
                continue
            us = evt.self_cpu_time_total
        if us:
            totals[classify(evt.key, on_cuda)] += us / 1e6
    return totals


def verdict(step_s: float, kernels: dict[str, float], data_s: float, mfu: float) -> tuple[str, dict]:
    """(limit, seconds by cause) of one step: compute (matmul + attention kernels), memory
    (every other kernel), communication (collectives the compute did not hide) or host (time
    no kernel ran: Python, launches, data loading)."""
    busy = kernels["matmul"] + kernels["attention"] + kernels["other"]
    idle = max(step_s - busy, 0.0)
    exposed_comm = min(kernels["communication"], idle)
    causes = {
        "compute": kernels["matmul"] + kernels["attention"],
        "memory": kernels["other"],
        "communication": exposed_comm,
        "host": max(idle - exposed_comm, data_s),
    }
    limit = max(causes, key=causes.get)
    shares = ", ".join(f"{k} {v / step_s:.0%}" for k, v in causes.items()) if step_s > 0 else ""
    compute_words = (f"compute-bound at {mfu:.0%} MFU: matmul/attention kernels fill the step"
                     if mfu >= 0.3 else
                     f"matmul/attention kernels fill the step but run at {mfu:.1%} of the roof: "
                     f"shapes too small to fill the device (a larger micro-batch or model)")
    words = {
        "compute": compute_words,
        "memory": "memory-bound: element-wise/norm/optimizer kernels take more time than the "
                  "matmuls (fuse them: --compile, --fused)",
        "communication": "communication-bound: collectives the backward pass did not hide",
        "host": "host-bound: the device waits on Python, kernel launches or data loading "
                "(--compile, a larger micro-batch)",
    }
    return f"{words[limit]} ({shares})", causes


def as_dict(obj) -> dict:
    return asdict(obj)
