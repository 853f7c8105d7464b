"""What every benchmark result carries, and how it is written.

A number without its context cannot be compared with the next one, so each
result is stamped with when it was taken, on what (GPU or CPU model, torch
version, cores, load average), from which code (git commit, "-dirty" when the
tree differs from it) and how (the command line). Results are written twice:
JSON for programs, and a markdown table for people and pull requests.

The helpers for the device a benchmark ran on (its name, its peak rates,
synchronizing before reading the clock) live here too, since latency and
throughput both need them and both stamp them into their results.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from typing import Any, Optional, Sequence

import rooflm.envs as envs
from rooflm.perf.gpus import cpu_model  # noqa: F401  (re-exported: the stamp names the CPU)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------- the stamp


def git_commit(repo_dir: str = REPO_ROOT) -> str:
    """`git rev-parse --short HEAD`, plus "-dirty" when the working tree differs from it.

    Untracked files count as dirty: in this repository new modules often exist
    before they are committed, and they change what was measured.
    --no-optional-locks keeps `git status` from rewriting the index, so taking
    a stamp never changes the repository's state.
    """
    commit = envs.get("ROOFLM_COMMIT")
    if commit:  # a copy of the tree without .git (the device machine)
        return commit
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo_dir,
                                capture_output=True, text=True, check=True).stdout.strip()
        status = subprocess.run(["git", "--no-optional-locks", "status", "--porcelain"],
                                cwd=repo_dir, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + "-dirty" if status.strip() else commit


def device_name(device) -> str:
    """What a person calls the device a torch.device points at."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model()


def stamp(device=None, argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Date, machine, code version and command line of a run.

    The load average is recorded because these benchmarks often run on shared
    CPUs, where another user's job changes the numbers.
    """
    import torch

    argv = list(sys.argv if argv is None else argv)
    if argv and os.path.basename(argv[0]) in ("rooflm", "__main__.py"):
        # The console script and `python -m rooflm` both print as the command a user types.
        argv[0] = "rooflm"
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    result = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_1_5_15min": load,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "command": " ".join(shlex.quote(a) for a in argv),
    }
    if device is not None:
        result["device"] = str(device)
        result["device_name"] = device_name(device)
    return result


# ---------------------------------------------------------------- writing


def write_json(path: str, result: dict) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
        f.write("\n")


def _cell(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) >= 1 else f"{value:.3g}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |",
             "| " + " | ".join("---" for _ in headers) + " |"]
    for row in rows:
        lines.append("| " + " | ".join(_cell(v) for v in row) + " |")
    return "\n".join(lines) + "\n"


def markdown_stamp(stamp_fields: dict) -> str:
    """The stamp as a bullet list, for the head of a markdown result."""
    keys = ("date", "device_name", "cpu", "cpu_cores", "torch_threads", "load_average_1_5_15min",
            "torch", "git_commit", "command")
    lines = []
    for key in keys:
        if key in stamp_fields:
            value = stamp_fields[key]
            text = f"`{value}`" if key == "command" else _cell(value)
            lines.append(f"- {key}: {text}")
    return "\n".join(lines) + "\n"


def write_markdown(path: str, title: str, stamp_fields: dict, headers: Sequence[str],
                   rows: Sequence[Sequence[Any]], notes: str = "") -> None:
    parts = [f"# {title}\n", markdown_stamp(stamp_fields), markdown_table(headers, rows)]
    if notes:
        parts.append(notes.rstrip() + "\n")
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(parts))


# ---------------------------------------------------------------- the device


def synchronize(device) -> None:
    """Wait for the device's queued work, so the clock reads when the work is done.

    The engine's step already copies the sampled token ids to the host, which
    waits for the GPU; this makes the timing correct without relying on that.
    """
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def resolve_gpu(device, gpu_name: Optional[str], cpu_bandwidth_gbs: Optional[float] = None,
                allow_other_gpu: bool = False):
    """The peak rates to judge a run against, as a GpuSpec, or None when there are none.

    CUDA: --gpu NAME from the table or "measure"; by default the H100 SXM
    datasheet on an H100 SXM, and a measurement on any other GPU (an H100 PCIe
    has 2.0 TB/s, not the SXM's 3.35, so its name alone is not enough).
    CPU: a bandwidth given with --cpu-bandwidth-gbs (no FLOP rates), else this
    CPU measured (perf/gpus.py, as `rooflm profile` does); "measure" is the same.
    With allow_other_gpu, --gpu NAME on the CPU gives that GPU's rates, for an
    analytic what-if bound; a utilization measured on one device against
    another's peak would mean nothing, so without it that is an error.
    """
    from rooflm.perf.gpus import GpuSpec, get_gpu
    from rooflm.perf.gpus import measure_host

    if device.type == "cuda":
        name = device_name(device).lower()
        if gpu_name and gpu_name.lower() != "measure":
            return get_gpu(gpu_name)
        if not gpu_name and "h100" in name and "pcie" not in name:
            return get_gpu("h100")
        return _measure(device)
    if cpu_bandwidth_gbs:
        return GpuSpec(key="cpu", name=cpu_model(), peak_tflops={}, mem_bw_gbs=cpu_bandwidth_gbs,
                       source="--cpu-bandwidth-gbs")
    if gpu_name and gpu_name.lower() != "measure":
        if not allow_other_gpu:
            raise ValueError(f"--gpu {gpu_name} is a GPU's datasheet and this run is on the CPU: "
                             f"leave --gpu out (or --gpu measure) to measure this CPU, or give "
                             f"--cpu-bandwidth-gbs")
        return get_gpu(gpu_name)
    return measure_host(device)


def _measure(device):
    """Measure the GPU's copy bandwidth and matmul rate next to an engine that holds its memory.

    The engine has already taken most of the memory for its KV cache; the
    measurement needs about 2.5 GB more, and gives it back afterwards.
    """
    import torch

    from rooflm.perf.gpus import measure_gpu

    try:
        return measure_gpu(str(device))
    except torch.cuda.OutOfMemoryError as exc:
        raise ValueError("not enough free GPU memory to measure the GPU next to the engine: pass "
                         "--gpu NAME, or a lower --gpu-memory-utilization") from exc
    finally:
        torch.cuda.empty_cache()


def dtype_bytes(dtype) -> float:
    """Bytes per element of a torch dtype: the weights, activations and KV cache all use it."""
    import torch

    return float(torch.tensor([], dtype=dtype).element_size())


def compute_dtype_name(dtype) -> str:
    """The roofline's name for the format the matmuls run in."""
    import torch

    if dtype == torch.float32:
        return "fp32"
    if dtype == torch.float16:
        return "fp16"
    return "bf16"
