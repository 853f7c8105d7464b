"""The peak rates of the machine a run is on, measured: one place for `profile`, `bench` and
`roofline --gpu measure` alike.

A GPU is measured by perf/gpus.py's measure_gpu (a 1 GiB device copy, an 8192^3 bf16 GEMM).
No table lists CPUs, so a CPU is measured here, the same way in spirit:

  * bandwidth: a copy of 128 MiB (larger than the L3 of the machines here, so every byte goes
    to DRAM), counted as bytes read + written, median of 5 after a warm-up;
  * FLOP rate: a 1024^3 matmul in fp32 and in bf16 (the dtypes the CPU paths run in), median
    of 5 after a warm-up, with the threads torch uses now.

The result is a GpuSpec (key "cpu") so every consumer reads peaks one way: mem_bw_gbs and
peak_flops(dtype). Measurements are cached per process and thread count: a CPU measurement
takes about a second, and a bench that measured twice would print two different roofs.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from rooflm.perf.gpus import GpuSpec, measure_gpu

CPU_COPY_BYTES = 128 << 20
CPU_MATMUL_N = 1024
REPEATS = 5

_cache: dict[tuple, GpuSpec] = {}


def _median_seconds(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    fn()  # warm-up: page faults, thread pool start, kernel selection
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_cpu() -> GpuSpec:
    """This CPU's copy bandwidth and fp32 / bf16 matmul rates, as a GpuSpec."""
    from rooflm.bench.results import cpu_model

    threads = torch.get_num_threads()
    src = torch.randn(CPU_COPY_BYTES // 4)  # random, non-zero: nothing compresses it
    dst = torch.empty_like(src)
    copy_gbs = 2 * CPU_COPY_BYTES / _median_seconds(lambda: dst.copy_(src)) / 1e9
    del src, dst
    n = CPU_MATMUL_N
    tflops = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.randn(n, n).to(dtype)
        b = torch.randn(n, n).to(dtype)
        tflops[name] = 2 * n**3 / _median_seconds(lambda: torch.mm(a, b)) / 1e12
    return GpuSpec(
        key="cpu", name=f"{cpu_model()} ({threads} threads, measured)", peak_tflops=tflops,
        mem_bw_gbs=copy_gbs,
        source=(f"measured: {CPU_COPY_BYTES >> 20} MiB copy {copy_gbs:.1f} GB/s, {n}^3 matmul "
                f"fp32 {tflops['fp32'] * 1e3:.1f} / bf16 {tflops['bf16'] * 1e3:.1f} GFLOP/s, "
                f"{threads} threads"))


def measure_host(device: "torch.device | str | None" = None) -> GpuSpec:
    """The measured peaks of `device` (default: CUDA when present, else the CPU), cached."""
    device = torch.device(device if device is not None
                          else ("cuda" if torch.cuda.is_available() else "cpu"))
    key = (str(device), torch.get_num_threads())
    if key not in _cache:
        _cache[key] = measure_gpu(str(device)) if device.type == "cuda" else measure_cpu()
    return _cache[key]
