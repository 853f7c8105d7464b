"""Round-to-nearest (RTN) weight quantization, and `--quantization int8 | int4-g<N>` at load.

  int8 per-channel, symmetric: scale = max|w_row| / 127, code = round(w / scale) in -127..127.
  int4 group-wise, asymmetric: per row and group of g inputs, scale = (max - min) / 15,
      zero = round(-min / scale) clamped to 1..15, code = clamp(round(w / scale) + zero, 0, 15).
      The zero is kept >= 1 because GPTQ's v1 layout stores zero - 1 in four bits (formats.py):
      a group whose weights are all positive loses at most one step of its range.

rooflm/model/quantize_on_load.py swaps a loaded float model's linears for these (dummy weights for
speed runs, or a float checkpoint quantized on the fly); `rooflm quantize` (rooflm/quantize/)
uses the same functions offline, with GPTQ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rooflm.quant.formats import ChannelWeight, GroupWeight

SCHEMES = ("int8", "int4-g32", "int4-g64", "int4-g128")


@dataclass(frozen=True)
class WeightScheme:
    bits: int  # 8 or 4
    group_size: int  # -1: per channel

    @staticmethod
    def parse(name: str) -> "WeightScheme":
        if name == "int8":
            return WeightScheme(8, -1)
        if name.startswith("int4-g") and name[6:].isdigit() and int(name[6:]) in (32, 64, 128):
            return WeightScheme(4, int(name[6:]))
        raise ValueError(f"quantization scheme must be one of {', '.join(SCHEMES)}; got {name!r}")

    def bytes_per_weight(self, scale_bytes: int = 2) -> float:
        if self.bits == 8:
            return 1.0
        return 0.5 + 2 * scale_bytes / self.group_size


def int4_params(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, zeros) [N, ceil(K/g)] fp32 for w [N, K] (min-max, asymmetric). A last group
    shorter than g (K = 576 at g = 128: SmolLM2) is padded with zeros, which the range already holds."""
    n, k = w.shape
    padded = torch.nn.functional.pad(w.float(), (0, -k % group_size))
    groups = padded.reshape(n, -1, group_size)
    lo = groups.amin(dim=2).clamp(max=0.0)
    hi = groups.amax(dim=2).clamp(min=0.0)
    scale = ((hi - lo) / 15.0).clamp_min(1e-10)
    zero = torch.round(-lo / scale).clamp(1, 15)
    return scale, zero


def int4_params_mse(w: torch.Tensor, weight: torch.Tensor | None = None,
                    shrinks: tuple[float, ...] = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) [N, 1] for one group w [N, g], the range shrunk by the factor (of those tried)
    that minimises the squared rounding error, each input weighted by `weight` [g] (e.g. diag(H)):
    clipping a few outliers buys a finer step for the rest (the `mse` option of GPTQ's reference)."""
    best_err = torch.full((w.shape[0],), float("inf"))
    best = None
    for p in shrinks:
        lo = (w.amin(dim=1) * p).clamp(max=0.0)
        hi = (w.amax(dim=1) * p).clamp(min=0.0)
        scale = ((hi - lo) / 15.0).clamp_min(1e-10)
        zero = torch.round(-lo / scale).clamp(1, 15)
        q = torch.clamp(torch.round(w / scale[:, None]) + zero[:, None], 0, 15)
        err = (q - zero[:, None]) * scale[:, None] - w
        err = (err * err * (1.0 if weight is None else weight[None, :])).sum(dim=1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = (scale, zero) if best is None else (torch.where(better, scale, best[0]), torch.where(better, zero, best[1]))
    return best[0][:, None], best[1][:, None]


def quantize_int4_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = w.shape
    s = scale.repeat_interleave(group_size, dim=1)[:, :k]
    z = zero.repeat_interleave(group_size, dim=1)[:, :k]
    return torch.clamp(torch.round(w.float() / s) + z, 0, 15)


def rtn_int4(w: torch.Tensor, group_size: int, scale_dtype: torch.dtype = torch.float16) -> GroupWeight:
    scale, zero = int4_params(w, group_size)
    # The scale is rounded to its stored dtype before the codes are chosen, so codes fit what is stored.
    scale = scale.to(scale_dtype).float()
    codes = quantize_int4_codes(w, scale, zero, group_size)
    return GroupWeight(codes.to(torch.uint8), scale.T.contiguous().to(scale_dtype),
                       zero.T.contiguous().to(scale_dtype), group_size, None, f"int4-g{group_size}")


def rtn_int8(w: torch.Tensor, scale_dtype: torch.dtype = torch.float16) -> ChannelWeight:
    scale = (w.float().abs().amax(dim=1) / 127.0).clamp_min(1e-10).to(scale_dtype).float()
    codes = torch.clamp(torch.round(w.float() / scale[:, None]), -127, 127).to(torch.int8)
    return ChannelWeight(codes, scale.to(scale_dtype), torch.zeros_like(scale, dtype=scale_dtype), "int8")


def quantize_weight(w: torch.Tensor, scheme: WeightScheme, scale_dtype: torch.dtype = torch.float16):
    return rtn_int8(w, scale_dtype) if scheme.bits == 8 else rtn_int4(w, scheme.group_size, scale_dtype)
