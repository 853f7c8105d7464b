"""Quantized HF checkpoints: which scheme config.json names, and their tensors grouped per linear.

config.json's `quantization_config` names the scheme (quant_method). rooflm reads:

  gptq  bits 4 (any group size, desc_act/g_idx, sym or asym) and bits 8 with group_size -1,
        checkpoint_format "gptq" (the v1 layout: zeros stored minus one; see formats.py)
  awq   bits 4, version "gemm", zero_point true (AutoAWQ's packing order)

Anything else fails at load with the scheme named. A quantized linear's tensors
(`<prefix>.qweight`, `.qzeros`, `.scales`, `.g_idx`) are collected and yielded as one
`<prefix>.weight` in rooflm's runtime form (formats.GroupWeight / ChannelWeight), so the model's
loader sees the same names as for a float checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from rooflm.model.errors import load_error
from rooflm.quant import formats

_PARTS = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales")}
_OPTIONAL = {"g_idx"}


@dataclass(frozen=True)
class QuantScheme:
    method: str  # gptq | awq
    bits: int
    group_size: int  # -1: one group per output channel
    desc_act: bool = False
    sym: bool = True

    def describe(self) -> str:
        g = "per-channel" if self.group_size == -1 else f"g{self.group_size}"
        return f"{self.method} int{self.bits} {g}" + (" act-order" if self.desc_act else "")


def parse_quant_config(cfg: dict[str, Any], config_path: str) -> Optional[QuantScheme]:
    """The scheme config.json declares, or None for a float checkpoint; unsupported ones raise."""
    qc = cfg.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "?")).lower()
    bits = int(qc.get("bits", qc.get("w_bit", 0)) or 0)
    group = int(qc.get("group_size", qc.get("q_group_size", -1)) or -1)
    if method == "gptq":
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt != "gptq":
            raise load_error(config_path, f"GPTQ checkpoint_format {fmt!r} is not supported (only 'gptq', v1)")
        if bits == 4 or (bits == 8 and group == -1):
            return QuantScheme("gptq", bits, group, bool(qc.get("desc_act", False)), bool(qc.get("sym", True)))
        raise load_error(config_path, f"GPTQ bits={bits} group_size={group} is not supported: rooflm runs "
                                      f"4-bit (any group size) and 8-bit per-channel (group_size -1)")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm" or not qc.get("zero_point", True):
            raise load_error(config_path, f"AWQ bits={bits} version={version!r} zero_point="
                                          f"{qc.get('zero_point')} is not supported (4-bit GEMM with zero points)")
        return QuantScheme("awq", 4, group)
    raise load_error(config_path, f"quantization scheme {method!r} is not supported; rooflm loads "
                                  f"'gptq' and 'awq' checkpoints (and GGUF Q4_0/Q4_1/Q8_0)")


def group_quantized(stream: Iterator[tuple[str, torch.Tensor, str]], scheme: QuantScheme,
                    act_dtype: torch.dtype = torch.float16) -> Iterator[tuple[str, Any, str]]:
    """Pass float tensors through; collect each quantized linear's parts into `<prefix>.weight`."""
    parts = _PARTS[scheme.method]
    pending: dict[str, dict[str, torch.Tensor]] = {}
    sources: dict[str, str] = {}
    for name, tensor, source in stream:
        prefix, _, leaf = name.rpartition(".")
        if leaf not in parts:
            yield name, tensor, source
            continue
        got = pending.setdefault(prefix, {})
        got[leaf] = tensor
        sources[prefix] = source
        if all(p in got for p in parts if p not in _OPTIONAL) and (
                scheme.method != "gptq" or "g_idx" in got):
            yield prefix + ".weight", _decode(scheme, pending.pop(prefix), act_dtype, source, prefix), source
    # GPTQ checkpoints without g_idx (older exports): decode what is complete.
    for prefix, got in pending.items():
        missing = [p for p in parts if p not in got and p not in _OPTIONAL]
        if missing:
            raise load_error(sources[prefix], f"quantized linear {prefix!r} lacks {', '.join(missing)}")
        yield prefix + ".weight", _decode(scheme, got, act_dtype, sources[prefix], prefix), sources[prefix]


def _decode(scheme: QuantScheme, t: dict[str, torch.Tensor], act_dtype, source: str, prefix: str):
    try:
        if scheme.method == "gptq":
            return formats.from_gptq(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), scheme.bits,
                                     scheme.group_size, act_dtype)
        return formats.from_awq(t["qweight"], t["qzeros"], t["scales"], scheme.group_size, act_dtype)
    except (ValueError, RuntimeError) as exc:
        raise load_error(source, f"cannot decode {scheme.describe()} linear {prefix!r}: {exc}") from exc
