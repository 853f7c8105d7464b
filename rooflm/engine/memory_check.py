"""Memory checked before it is allocated.

Before the model runner creates a parameter, it adds up what the load will hold: the weights,
the KV cache (on the CPU its pool and the swap pool are fixed by the config; on CUDA the pool is
sized later from what is left, so only the weights and activations must fit), and the
activations of the largest step. A load that cannot fit is refused with the numbers and what
to change, instead of running the machine out of memory (an 8B preset in fp32 on a 23 GB host
was ended by the kernel's OOM killer after 98 s, and a global OOM can take other processes
with it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

GB = 1e9


@dataclass(frozen=True)
class MemoryNeed:
    weights: int
    kv_cache: int
    activations: int
    device: str

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations


class InsufficientMemoryError(ValueError):
    """The load would not fit; raised before anything is allocated."""


def available_bytes(device: torch.device) -> Optional[int]:
    """Free memory where the tensors will live: MemAvailable of /proc/meminfo for the CPU,
    free device memory for CUDA; None where it cannot be read (then nothing is checked)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_fits(need: MemoryNeed, available: Optional[int], model: str, dtype: torch.dtype) -> None:
    if available is None or need.total <= available:
        return
    where = "RAM" if need.device == "cpu" else f"{need.device} memory"
    tries = []
    if dtype == torch.float32:
        tries.append("--load-format dummy with --dtype bfloat16 (half the weight bytes)" if need.device == "cpu"
                     else "--dtype bfloat16")
    if need.kv_cache > 0:
        tries.append("a smaller --cpu-kv-cache-gb or --swap-space-gb")
    tries.append("a smaller --max-num-batched-tokens or --max-num-seqs")
    tries.append("a smaller model")
    raise InsufficientMemoryError(
        f"{model} needs {need.total / GB:.1f} GB of {where} (weights {need.weights / GB:.1f} GB, "
        f"KV cache {need.kv_cache / GB:.1f} GB, activations {need.activations / GB:.1f} GB), "
        f"{available / GB:.1f} GB available; try {', '.join(tries)}")
