"""Mixed precision of a training step.

Parameters and optimizer state stay fp32 (the master copy) in every mode; what changes is
the dtype the matmuls run in:
  fp32  no autocast.
  bf16  torch.autocast(bfloat16): bf16's range is fp32's, so gradients need no scaling.
  fp16  torch.autocast(float16) with dynamic loss scaling (torch.amp.GradScaler): fp16
        gradients below ~6e-8 flush to zero, so the loss is multiplied by a scale that
        grows while steps stay finite and halves (skipping the step) when one overflows.
  fp8   torchao's float8 training (dynamic scaling, per-tensor) on top of bf16 autocast;
        needs torchao, and for speed a GPU with fp8 tensor cores (H100 and later); on a CPU
        torchao emulates it (the path runs and is tested; it is not faster).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Precision:
    name: str
    autocast_dtype: Optional[torch.dtype]  # None: fp32, no autocast
    loss_scaling: bool
    peak_format: str  # the rooflm.perf.gpus rate MFU is measured against
    memory_dtype: str  # the rooflm.perf.memory training dtype

    def autocast(self, device_type: str):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.autocast_dtype)

    def grad_scaler(self, device_type: str) -> Optional["torch.amp.GradScaler"]:
        return torch.amp.GradScaler(device_type) if self.loss_scaling else None


PRECISIONS = {
    "fp32": Precision("fp32", None, False, "fp32", "fp32"),
    "bf16": Precision("bf16", torch.bfloat16, False, "bf16", "bf16"),
    "fp16": Precision("fp16", torch.float16, True, "bf16", "fp16"),
    "fp8": Precision("fp8", torch.bfloat16, False, "fp8", "bf16"),
}


def sdpa_priority(backend: str):
    """A context that tries `backend`'s attention kernel first and falls back through torch's
    others where it does not apply (cuDNN's is the fastest on an H100; see DESIGN.md)."""
    if backend == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    first = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[backend]
    order = [first] + [b for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                                   SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH) if b != first]
    return sdpa_kernel(order, set_priority=True)


def get_precision(name: str, device_type: str) -> Precision:
    if name not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {name!r}")
    if name == "fp8":
        check_fp8(device_type)
    return PRECISIONS[name]


def check_fp8(device_type: str) -> None:
    """fp8 training is torchao's; say what is missing instead of failing deep inside."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"--precision fp8 needs torchao's float8 training (pip install torchao); "
                         f"it does not import here: {exc}") from exc
    if device_type != "cuda":
        return  # emulated
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        raise ValueError(f"--precision fp8 needs fp8 tensor cores (compute capability 8.9+); "
                         f"this GPU is {major}.{minor}")


def convert_to_fp8(model: torch.nn.Module) -> int:
    """Swap every rooflm Linear inside the decoder blocks for torchao's Float8Linear (the LM head
    stays bf16, as torchtitan leaves it). Returns how many were swapped."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    from rooflm.layers.linear import Linear

    config = Float8LinearConfig()
    swapped = 0
    for block in model.blocks:
        for parent in list(block.modules()):
            for child_name, child in list(parent.named_children()):
                if not isinstance(child, Linear) or child.quant is not None:
                    continue
                plain = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                        device="meta")
                plain.weight = child.weight
                plain.bias = child.bias
                fp8 = Float8Linear.from_float(plain, config=config)
                # rooflm's fused layers keep their shard map for checkpoint export.
                if hasattr(child, "shard_offsets"):
                    fp8.shard_offsets = child.shard_offsets
                setattr(parent, child_name, fp8)
                swapped += 1
    return swapped
