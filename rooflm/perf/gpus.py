"""Peak rates of the GPUs the roofline model knows, and the one measurement of this machine's
peaks (its GPU, else its CPU) that `profile`, `bench` and `roofline --gpu measure` all use.

Every number in the table is a *dense* datasheet peak (no 2:4 sparsity): a
kernel that reaches it is at the roof. "fp32" is the CUDA-core (non-tensor)
rate that element-wise kernels such as RMSNorm run at; "tf32", "bf16", "fp8"
and "int8" are tensor-core rates with the precision of the inputs. A GPU
without a format in hardware (V100 has no bf16, A100 no fp8) simply lacks the
key, and `peak_flops` falls back to the rate the work would really run at.

Memory bandwidth is in GB/s (1e9 bytes per second) as the datasheets print it.
`interconnect_gbs` is the per-direction GPU-to-GPU bandwidth that a ring
all-reduce under tensor parallelism sees (NVLink, or PCIe where there is none).

The ridge point of a GPU, peak FLOP/s over bytes/s, is the arithmetic intensity
(FLOP per byte moved) at which a kernel stops waiting on memory and starts
waiting on arithmetic: A100 bf16 312e12 / 2.0e12 = 156 FLOP/B, H100 SXM
989e12 / 3.35e12 = 295 FLOP/B.
"""

from __future__ import annotations

import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

# The format a kernel would fall back to when the GPU lacks the one asked for:
# fp8 weights on an A100 are dequantized and multiplied in bf16 (Marlin-style),
# bf16 on a V100 runs as fp16 on the same tensor cores (the "bf16" key of V100
# holds its fp16 rate for that reason), and so on down to plain fp32.
_FALLBACK = {"fp8": "bf16", "int8": "bf16", "bf16": "fp32", "fp16": "bf16", "tf32": "fp32"}

# A CPU's native int8 block kernels (rooflm/quant/csrc/block_matmul.c) unpack each weight block
# once for a tile of BLOCK_DOT_TILE tokens; a matmul of fewer tokens a row (a decode of 1-3
# sequences) unpacks it for every token and runs at the rate measured under this key.
BLOCK_DOT_TILE = 4
INT8_ONE_TOKEN = "int8-1tok"


@dataclass(frozen=True)
class GpuSpec:
    """Peak rates of one GPU, datasheet or measured."""

    key: str  # table key, e.g. "h100"
    name: str  # what a person reads, e.g. "NVIDIA H100 SXM5 80GB"
    peak_tflops: dict[str, float] = field(hash=False)  # format -> dense TFLOP/s (TOPS for int8)
    mem_bw_gbs: float = 0.0  # HBM/GDDR bandwidth, GB/s
    mem_gb: float = 0.0  # device memory, GB (1e9 bytes)
    l2_mb: float = 0.0  # L2 cache, MB
    interconnect_gbs: Optional[float] = None  # per-direction GPU-to-GPU bandwidth, GB/s
    source: str = "datasheet"  # "datasheet", or how it was measured
    device: str = "cuda"  # "cuda", or "cpu" for a CPU's roofs (measure_cpu): names its roofs

    @property
    def is_cpu(self) -> bool:
        return self.device == "cpu"

    def compute_roof_name(self, dtype: str) -> str:
        """What runs matmuls of `dtype`: tensor cores on a GPU, the SIMD units on a CPU (fp32:
        FMA; int8: the native kernels' integer dot of GGUF blocks with int8 activations)."""
        if self.is_cpu:
            if dtype == INT8_ONE_TOKEN:
                return "int8 SIMD dot, 1 token a row"
            return "int8 SIMD dot" if dtype == "int8" else f"{dtype} SIMD FMA"
        return f"{dtype} tensor cores"

    @property
    def vector_roof_name(self) -> str:
        """What element-wise kernels run on."""
        return "fp32 SIMD FMA" if self.is_cpu else "fp32 CUDA cores"

    @property
    def memory_name(self) -> str:
        return "DRAM" if self.is_cpu else "HBM"

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for work in `dtype`, falling back where the GPU lacks the format."""
        key = "bf16" if dtype == "fp16" else dtype
        while key not in self.peak_tflops:
            if key not in _FALLBACK:
                raise KeyError(f"{self.name} has no peak rate for {dtype!r}")
            key = _FALLBACK[key]
        return self.peak_tflops[key] * 1e12

    @property
    def mem_bw(self) -> float:
        """Memory bandwidth in bytes per second."""
        return self.mem_bw_gbs * 1e9

    def ridge_point(self, dtype: str = "bf16") -> float:
        """Arithmetic intensity (FLOP/B) where the compute roof meets the memory roof."""
        return self.peak_flops(dtype) / self.mem_bw


GPUS: dict[str, GpuSpec] = {
    # Tesla V100 SXM2 32GB. No bf16 hardware: the bf16 entry is the fp16 tensor
    # rate, the closest thing a bf16 model would run at after a cast.
    "v100": GpuSpec(
        key="v100", name="NVIDIA V100 SXM2 32GB",
        peak_tflops={"fp32": 15.7, "bf16": 125.0, "int8": 62.8},
        mem_bw_gbs=900.0, mem_gb=32.0, l2_mb=6.0, interconnect_gbs=150.0),
    # A100 SXM4 80GB. The datasheet prints 2,039 GB/s; the field's worked
    # examples round it to 2.0 TB/s, which gives the familiar ridge of 156.
    "a100": GpuSpec(
        key="a100", name="NVIDIA A100 SXM4 80GB",
        peak_tflops={"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "int8": 624.0},
        mem_bw_gbs=2000.0, mem_gb=80.0, l2_mb=40.0, interconnect_gbs=300.0),
    "h100": GpuSpec(
        key="h100", name="NVIDIA H100 SXM5 80GB",
        peak_tflops={"fp32": 67.0, "tf32": 494.5, "bf16": 989.0, "fp8": 1979.0, "int8": 1979.0},
        mem_bw_gbs=3350.0, mem_gb=80.0, l2_mb=50.0, interconnect_gbs=450.0),
    # What this project measured on its H100 (docs: DESIGN.md, 2026-11-21):
    # a bf16 8192^3 matmul at 759 TFLOP/s and a device-to-device copy at
    # 3,008 GB/s counting bytes read plus written. The formats that were not
    # measured are the datasheet scaled by the same 759/989 fraction, since
    # the clocks and power limit that cost bf16 its 23% cost them as much.
    "h100-measured": GpuSpec(
        key="h100-measured", name="NVIDIA H100 SXM5 80GB (measured by rooflm, 2026-11-21)",
        peak_tflops={"fp32": 67.0 * 759 / 989, "tf32": 494.5 * 759 / 989, "bf16": 759.0,
                     "fp8": 1979.0 * 759 / 989, "int8": 1979.0 * 759 / 989},
        mem_bw_gbs=3008.0, mem_gb=80.0, l2_mb=50.0, interconnect_gbs=450.0,
        source="measured: bf16 matmul 8192^3, device-to-device copy"),
    # H200 SXM: the H100's GH100 die with 141 GB of HBM3e at 4.8 TB/s.
    "h200": GpuSpec(
        key="h200", name="NVIDIA H200 SXM 141GB",
        peak_tflops={"fp32": 67.0, "tf32": 494.5, "bf16": 989.0, "fp8": 1979.0, "int8": 1979.0},
        mem_bw_gbs=4800.0, mem_gb=141.0, l2_mb=50.0, interconnect_gbs=450.0),
    # HGX B200 at 1,000 W. The L2 size is not in the datasheet; 126 MB is what
    # public microbenchmarks of the two-die part report.
    "b200": GpuSpec(
        key="b200", name="NVIDIA B200 (HGX, 1000 W) 180GB",
        peak_tflops={"fp32": 80.0, "tf32": 1100.0, "bf16": 2250.0, "fp8": 4500.0, "int8": 4500.0},
        mem_bw_gbs=8000.0, mem_gb=180.0, l2_mb=126.0, interconnect_gbs=900.0),
    # L4: PCIe card, no NVLink; the interconnect is PCIe Gen4 x16.
    "l4": GpuSpec(
        key="l4", name="NVIDIA L4 24GB",
        peak_tflops={"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp8": 242.5, "int8": 242.5},
        mem_bw_gbs=300.0, mem_gb=24.0, l2_mb=48.0, interconnect_gbs=32.0),
    # RTX 4090 (Ada whitepaper). GeForce tensor cores run at half rate with fp32
    # accumulation, which is what bf16/fp8 GEMMs use: 165 TFLOP/s bf16, not 330.
    "rtx4090": GpuSpec(
        key="rtx4090", name="NVIDIA GeForce RTX 4090 24GB",
        peak_tflops={"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp8": 330.3, "int8": 660.6},
        mem_bw_gbs=1008.0, mem_gb=24.0, l2_mb=72.0, interconnect_gbs=32.0),
    # Jetson AGX Orin 64GB, GPU only (the DLAs are not counted): 2048 CUDA
    # cores, 64 tensor cores; memory is LPDDR5 shared with the CPU.
    "orin": GpuSpec(
        key="orin", name="NVIDIA Jetson AGX Orin 64GB (GPU)",
        peak_tflops={"fp32": 5.3, "tf32": 21.3, "bf16": 42.5, "int8": 85.0},
        mem_bw_gbs=204.8, mem_gb=64.0, l2_mb=4.0, interconnect_gbs=None),
}

_ALIASES = {
    "v100-sxm": "v100", "a100-80gb": "a100", "a100-sxm": "a100", "h100-sxm": "h100",
    "h100-sxm5": "h100", "measured-h100": "h100-measured", "h200-sxm": "h200",
    "4090": "rtx4090", "rtx-4090": "rtx4090", "jetson-orin": "orin", "agx-orin": "orin",
}


def get_gpu(name: str) -> GpuSpec:
    """A GPU of the table by key or alias; "measure" measures this machine instead (its GPU,
    else its CPU: measure_host); "cpu" measures this CPU; "auto" is the device the engine would
    run on: the table entry of the visible CUDA GPU (measured when the table lacks it), else
    this CPU, measured."""
    key = name.lower()
    if key == "measure":
        return measure_host()
    if key == "cpu":
        return measure_host("cpu")
    if key == "auto":
        return present_device()
    key = _ALIASES.get(key, key)
    if key not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}, or 'measure'")
    return GPUS[key]


def _match_table_entry(device_name: str) -> Optional[GpuSpec]:
    """The datasheet entry for a CUDA device name, so unmeasured formats can be scaled from it."""
    lowered = device_name.lower()
    # Order matters: "h100" is a substring test, so the more specific names go first.
    for token, key in (("b200", "b200"), ("h200", "h200"), ("h100", "h100"), ("a100", "a100"),
                       ("v100", "v100"), ("l4", "l4"), ("4090", "rtx4090"), ("orin", "orin")):
        if token in lowered:
            return GPUS[key]
    return None


def _time_cuda(fn, warmup: int, repeats: int) -> float:
    """Median seconds of `fn` over `repeats` runs, timed with CUDA events after warm-up."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def measure_gpu(device: Optional[str] = None, copy_bytes: int = 1 << 30, matmul_n: int = 8192,
                repeats: int = 20) -> GpuSpec:
    """Measure the present GPU's copy bandwidth and bf16 matmul rate; return them as a GpuSpec.

    Bandwidth is a device-to-device copy of `copy_bytes` (1 GiB, far larger than
    any L2, so every byte goes to HBM) counted as bytes read plus bytes written,
    the way the project's reference numbers count it. The matmul rate is a bf16
    matmul_n^3 GEMM at 2*n^3 FLOPs, a size big enough to reach the tensor-core
    roof. The CUDA-core fp32 rate is measured as an fp32 GEMM with TF32 off.
    Formats not measured (tf32, fp8, int8) are the datasheet entry of the
    matching GPU scaled by measured/datasheet bf16, and left out when the GPU
    is not in the table.
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("--gpu measure needs a CUDA GPU; none is visible to torch")
    dev = torch.device(device or "cuda")
    props = torch.cuda.get_device_properties(dev)
    _say(f"measuring {props.name}: {copy_bytes >> 20} MiB copy")

    # Copy bandwidth. Poisoned, non-zero data: some memory systems compress zeros.
    num_elems = copy_bytes // 2
    src = torch.randn(num_elems, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    copy_s = _time_cuda(lambda: dst.copy_(src), warmup=5, repeats=repeats)
    copy_gbs = 2 * num_elems * 2 / copy_s / 1e9
    del src, dst

    # bf16 tensor-core rate.
    _say(f"measuring {props.name}: {matmul_n}^3 bf16 matmul")
    a = torch.randn(matmul_n, matmul_n, dtype=torch.bfloat16, device=dev)
    b = torch.randn(matmul_n, matmul_n, dtype=torch.bfloat16, device=dev)
    mm_s = _time_cuda(lambda: torch.matmul(a, b), warmup=5, repeats=repeats)
    bf16_tflops = 2 * matmul_n**3 / mm_s / 1e12
    del a, b

    # CUDA-core fp32 rate: an fp32 GEMM with TF32 disabled never touches tensor cores.
    n32 = 4096
    _say(f"measuring {props.name}: {n32}^3 fp32 matmul")
    previous_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        a32 = torch.randn(n32, n32, dtype=torch.float32, device=dev)
        b32 = torch.randn(n32, n32, dtype=torch.float32, device=dev)
        fp32_s = _time_cuda(lambda: torch.matmul(a32, b32), warmup=3, repeats=max(5, repeats // 2))
        fp32_tflops = 2 * n32**3 / fp32_s / 1e12
        del a32, b32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous_tf32

    peaks = {"fp32": fp32_tflops, "bf16": bf16_tflops}
    table = _match_table_entry(props.name)
    if table is not None:
        fraction = bf16_tflops / table.peak_tflops["bf16"]
        for fmt in ("tf32", "fp8", "int8"):
            if fmt in table.peak_tflops:
                peaks[fmt] = table.peak_tflops[fmt] * fraction
    l2_bytes = getattr(props, "L2_cache_size", 0)
    return GpuSpec(
        key="measured", name=f"{props.name} (measured)", peak_tflops=peaks,
        mem_bw_gbs=copy_gbs, mem_gb=props.total_memory / 1e9,
        l2_mb=l2_bytes / 1e6 if l2_bytes else (table.l2_mb if table else 0.0),
        interconnect_gbs=table.interconnect_gbs if table else None,
        source=(f"measured: {matmul_n}^3 bf16 matmul {bf16_tflops:.0f} TFLOP/s, "
                f"{copy_bytes >> 20} MiB copy {copy_gbs:.0f} GB/s"
                + (f"; tf32/fp8/int8 scaled from the {table.key} datasheet" if table else "")))


# ---- this machine's CPU, and the one measurement everything uses -----------------------------
#
# The peak rates of the machine a run is on, measured: one place for `profile`, `bench` and
# `roofline --gpu measure` alike.
#
# A GPU is measured by perf/gpus.py's measure_gpu (a 1 GiB device copy, an 8192^3 bf16 GEMM).
# No table lists CPUs, so a CPU is measured here, the same way in spirit:
#
#   * bandwidth: a copy of 128 MiB (larger than the L3 of the machines here, so every byte goes
#     to DRAM), counted as bytes read + written, with the threads torch uses now and with one
#     (the better of the two: on a busy machine a parallel copy waits on its descheduled thread);
#   * FLOP rates, one core's times the threads torch uses (a compute roof is its cores' sum, as a
#     datasheet counts it; all threads timed together on a shared machine time the neighbours
#     instead: an OpenMP region waits for its slowest thread, and at load 7 on the shared 2-core
#     Xeon a 3 ms block matmul took 20-30 ms at 2 threads in 29 runs of 30, 2026-11-29):
#       - fp32 and bf16: a 1024^3 and a 512^3 matmul (the dtypes the CPU's float paths run in);
#       - int8: rooflm's own GGUF block matmuls (quant/native.py), the kernels a GGUF model's
#         layers run in on a CPU, on a weight that stays in cache (CPU_BLOCK_DOT_SHAPE), counted
#         in the model's FLOPs (2 a weight a token). Their integer dot of 32 codes an instruction
#         sounds faster than the fp32 FMA; it is not: two int8 activation levels, the nibble
#         unpacking and the scale FMAs of each block run at about a third of a 1024^3 fp32
#         matmul's rate on AVX2, which makes a batch-1 decode of the default model compute-bound
#         on this roof, not DRAM-bound. Taking the fp32 rate for it (as this did before issue 52)
#         put the bound 3-4x under what `bench latency` measures.
#
# Each rate is the best of REPEATS runs after a warm-up: a peak is the fastest a run went, and a
# neighbour only ever makes a run slower (a median taken beside other jobs understated the roofs
# up to 2x). One core's runs are timed in its thread's CPU seconds, which leave out the time the
# scheduler gave other jobs. The result is a GpuSpec (key "cpu") so every consumer reads peaks one way:
# mem_bw_gbs and peak_flops(dtype). Measurements are cached per process and thread count: a CPU
# measurement takes a few seconds, and a bench that measured twice would print two different roofs.

CPU_COPY_BYTES = 128 << 20
CPU_MATMUL_N = 1024
# bf16 without AMX runs at a fraction of the fp32 rate on a CPU: a 512^3 matmul shows the same
# rate in an eighth of the time (a 1024^3 one took 0.4 s a run on one core of the shared Xeon).
CPU_BF16_MATMUL_N = 512
# (rows N, columns K, tokens M) of the block matmul timed for the int8 roof: N x K blocks (1.3 MB
# of Q4, 2.2 MB of Q8: in L2 or L3, so the kernel, not DRAM, sets the time) against M tokens, two
# of the kernel's tiles (its best case); the one-token roof times the same weight against 1.
CPU_BLOCK_DOT_SHAPE = (2048, 1024, 2 * BLOCK_DOT_TILE)
REPEATS = 5

_cache: dict[tuple, GpuSpec] = {}


def _say(text: str) -> None:
    """A line on stderr while a measurement runs (a GPU's takes most of a minute)."""
    print(f"rooflm: {text}", file=sys.stderr, flush=True)


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo, or what platform knows elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _best_seconds(fn: Callable[[], object], repeats: int = REPEATS,
                  clock: Callable[[], float] = time.perf_counter) -> float:
    fn()  # warm-up: page faults, thread pool start, kernel selection
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return min(times)


def _best_thread_seconds(fn: Callable[[], object]) -> float:
    """The best of REPEATS runs of `fn` on this thread alone, in this thread's CPU seconds: the time
    the scheduler gave other jobs is not in it (a 128 MiB copy beside load 13 on 2 cores read
    3.3 GB/s by the wall clock, every run sliced)."""
    return _best_seconds(fn, clock=time.thread_time)


def measure_block_dot_tflops(shape: tuple[int, int, int] = CPU_BLOCK_DOT_SHAPE,
                             clock: Callable[[], float] = time.perf_counter) -> Optional[float]:
    """The int8 roof of this CPU: rooflm's native Q4_1 and Q8_0 block matmuls on an in-cache
    weight (the faster of the two: a roof is the best rate), in TFLOP/s of the model's FLOPs;
    None where the native kernels do not run (no compiler, no AVX2: the engine then takes
    torch's weight-only kernels, priced at the bf16 rate through GpuSpec's fallback). clock:
    time.thread_time for a one-thread measurement that the scheduler's slicing cannot reach."""
    import torch

    from rooflm.quant import native

    lib = native.library()
    if lib is None:
        return None
    n, k, m = shape
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen)
    scale = (torch.rand(n, k // 32, generator=gen) * 1e-2).half()
    codes4 = torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8, generator=gen)
    codes8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    offset = -8 * scale
    q4 = _best_seconds(lambda: native.q4_linear(lib, x, codes4, scale, offset), clock=clock)
    q8 = _best_seconds(lambda: native.q8_linear(lib, x, codes8, scale), clock=clock)
    return 2 * n * k * m / min(q4, q8) / 1e12


def measure_cpu() -> GpuSpec:
    """This CPU's copy bandwidth, fp32 / bf16 matmul rates and native int8 block-dot rate."""
    import torch

    threads = torch.get_num_threads()
    _say(f"measuring this CPU ({threads} threads): {CPU_COPY_BYTES >> 20} MiB copy, {CPU_MATMUL_N}^3 "
         f"matmuls, the native block matmuls")
    src = torch.randn(CPU_COPY_BYTES // 4)  # random, non-zero: nothing compresses it
    dst = torch.empty_like(src)
    copy_s = _best_seconds(lambda: dst.copy_(src))
    n, n16 = CPU_MATMUL_N, CPU_BF16_MATMUL_N
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    torch.set_num_threads(1)
    try:
        copy_s = min(copy_s, _best_thread_seconds(lambda: dst.copy_(src)))
        one_core = {"fp32": 2 * n**3 / _best_thread_seconds(lambda: torch.mm(a, b)) / 1e12}
        a16, b16 = a[:n16, :n16].bfloat16(), b[:n16, :n16].bfloat16()
        one_core["bf16"] = 2 * n16**3 / _best_thread_seconds(lambda: torch.mm(a16, b16)) / 1e12
        block_dot = measure_block_dot_tflops(clock=time.thread_time)
        n_rows, k_cols, _ = CPU_BLOCK_DOT_SHAPE
        one_token = measure_block_dot_tflops((n_rows, k_cols, 1), clock=time.thread_time)
    finally:
        torch.set_num_threads(threads)
    del src, dst
    copy_gbs = 2 * CPU_COPY_BYTES / copy_s / 1e9
    if block_dot is not None:
        one_core["int8"] = block_dot
        one_core[INT8_ONE_TOKEN] = one_token
        int8_note = f"native int8 block dot {block_dot * 1e3:.1f} ({one_token * 1e3:.1f} at 1 token a row)"
    else:
        int8_note = "no native block kernels (int8 at the bf16 rate)"
    tflops = {name: rate * threads for name, rate in one_core.items()}
    return GpuSpec(
        key="cpu", name=f"{cpu_model()} ({threads} threads, measured)", peak_tflops=tflops,
        mem_bw_gbs=copy_gbs, device="cpu",
        source=(f"measured, best of {REPEATS}: {CPU_COPY_BYTES >> 20} MiB copy {copy_gbs:.1f} GB/s; one core: "
                f"matmul fp32 {one_core['fp32'] * 1e3:.1f} ({n}^3) / bf16 {one_core['bf16'] * 1e3:.1f} ({n16}^3), "
                f"{int8_note} GFLOP/s, x {threads} threads"))


def measure_host(device=None) -> GpuSpec:
    """The measured peaks of `device` (default: CUDA when present, else the CPU), cached."""
    import torch

    device = torch.device(device if device is not None
                          else ("cuda" if torch.cuda.is_available() else "cpu"))
    key = (str(device), torch.get_num_threads())
    if key not in _cache:
        _cache[key] = measure_gpu(str(device)) if device.type == "cuda" else measure_cpu()
    return _cache[key]


def present_device() -> GpuSpec:
    """The roofs of the device the engine would run on: the visible CUDA GPU's datasheet entry
    (measured where the table has none), else this CPU, measured."""
    import torch

    if torch.cuda.is_available():
        return _match_table_entry(torch.cuda.get_device_name()) or measure_host("cuda")
    return measure_host("cpu")
