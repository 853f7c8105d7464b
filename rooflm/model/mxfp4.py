"""MXFP4 checkpoint tensors (OCP Microscaling Formats (MX) v1.0; gpt-oss's experts), dequantized on load.

A tensor W [..., rows, K] is stored as two, each quantized along its last (input) dimension in
blocks of 32 values:
    W_blocks [..., rows, K / 32, 16] uint8   32 FP4 E2M1 codes a block, two a byte: element 2j in
                                              the low nibble, 2j + 1 in the high one
    W_scales [..., rows, K / 32]     uint8   one E8M0 shared scale a block: 2^(s - 127); 255 is NaN
and each element is E2M1(code) * 2^(s - 127). E2M1 is sign (bit 3), exponent (bits 2-1, bias 1) and
one mantissa bit (bit 0): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives. Every such product is a
bf16 number (bf16 has E8M0's exponent range), so dequantizing to bf16 is exact.

gpt-oss's checkpoints quantize the experts' weights as nn.Linear stores them, [E, out, in], and name
them for its bf16 tensors, x @ W, [E, in, out]: gate_up_proj_blocks / _scales stand for
experts.gate_up_proj [E, H, 2I], down_proj_blocks / _scales for experts.down_proj [E, I, H]
(model/gpt_oss.py). dequantized_stream turns each pair into that tensor, so the rest of the loader
sees a bf16 checkpoint. A native MXFP4 GEMM would keep the blocks; this loads them as bf16 weights.

pack_mxfp4 is the spec's conversion (shared exponent floor(log2(amax)) - 2, E2M1's emax; elements
rounded to nearest, ties to even, saturating at +-6), for tests and for writing such files.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

BLOCK = 32  # elements per shared scale
E8M0_BIAS = 127
E8M0_NAN = 255
E2M1_EMAX = 2  # the largest E2M1 magnitude, 6 = 1.5 * 2^2
ROWS_PER_CHUNK = 4096  # rows dequantized at once
_BLOCKS, _SCALES = "_blocks", "_scales"


def e2m1_values() -> torch.Tensor:
    """The 16 E2M1 codes' values (fp32), from the format's bit fields."""
    values = []
    for code in range(16):
        sign = -1.0 if code & 0b1000 else 1.0
        exponent, mantissa = (code >> 1) & 0b11, code & 1
        magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
        values.append(sign * magnitude)
    return torch.tensor(values, dtype=torch.float32)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[..., G, 16] uint8 codes and [..., G] uint8 E8M0 scales -> [..., G * 32] values in dtype."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}: "
                         f"blocks must be scales' shape + ({BLOCK // 2},)")
    codes = torch.arange(256, device=blocks.device)
    lut = e2m1_values().to(blocks.device)
    byte_values = torch.stack((lut[codes & 0x0F], lut[codes >> 4]), dim=-1)  # a byte's two values, low nibble first
    groups = scales.shape[-1]
    rows_blocks, rows_scales = blocks.reshape(-1, groups, BLOCK // 2), scales.reshape(-1, groups)
    out = torch.empty(rows_scales.shape[0], groups * BLOCK, dtype=dtype, device=blocks.device)
    # a few rows at a time: the fp32 values of a whole gpt-oss expert tensor would take ~2 GB
    for start in range(0, out.shape[0], ROWS_PER_CHUNK):
        b, sc = rows_blocks[start:start + ROWS_PER_CHUNK], rows_scales[start:start + ROWS_PER_CHUNK]
        values = byte_values[b.int()].reshape(b.shape[0], groups, BLOCK)
        # times 2^(s - 127): a power of two, exact in fp32 (subnormal at the bottom of E8M0's range)
        scale = torch.exp2(sc.float() - E8M0_BIAS).masked_fill(sc == E8M0_NAN, float("nan"))
        out[start:start + ROWS_PER_CHUNK] = (values * scale[..., None]).flatten(-2)
    return out.reshape(*scales.shape[:-1], groups * BLOCK)


def pack_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] (K a multiple of 32) -> (blocks [..., K / 32, 16], scales [..., K / 32]) as the spec
    converts: X = 2^(floor(log2(amax)) - emax) per block, each element x / X to its nearest E2M1
    value (ties to the even code), saturating at +-6; a block of zeros takes the smallest scale."""
    if x.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 packs the last dimension in blocks of {BLOCK}; got {x.shape[-1]}")
    xf = x.float().reshape(*x.shape[:-1], -1, BLOCK)
    amax = xf.abs().amax(dim=-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(torch.finfo(torch.float32).tiny))) - E2M1_EMAX,
                           torch.full_like(amax, -E8M0_BIAS))
    exponent = exponent.clamp(-E8M0_BIAS, E8M0_NAN - 1 - E8M0_BIAS)
    scaled = xf / torch.ldexp(torch.ones_like(exponent), exponent)[..., None]
    magnitudes = e2m1_values()[:8].to(x.device)  # codes 0..7: the non-negative values, ascending
    distance = (scaled.abs()[..., None] - magnitudes).abs()
    nearest = distance == distance.amin(dim=-1, keepdim=True)
    # among equally near values the even code (mantissa 0); saturation is the nearest value, 6
    even_first = nearest * (2 - (torch.arange(8, device=x.device) & 1))
    code = even_first.argmax(dim=-1).to(torch.uint8) | ((scaled < 0).to(torch.uint8) << 3)
    pairs = code.reshape(*code.shape[:-1], BLOCK // 2, 2)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks, (exponent + E8M0_BIAS).to(torch.uint8)


def declared(raw_config: dict[str, Any]) -> bool:
    """Whether config.json says the checkpoint holds MXFP4 tensors (quant_method "mxfp4")."""
    qc = raw_config.get("quantization_config") or {}
    return str(qc.get("quant_method", "")).lower() == "mxfp4"


def dequantized_stream(stream: Iterator[tuple[str, Any, str]]) -> Iterator[tuple[str, torch.Tensor, str]]:
    """(name, tensor, source file) with every X_blocks / X_scales pair replaced by X: dequantized to
    bf16 and transposed from the stored [..., out, in] to the checkpoint's [..., in, out]. The other
    tensors pass as they come; a pair may be split across files. A lone half raises, named."""
    pending: dict[str, tuple[str, Any, str]] = {}
    for name, tensor, source in stream:
        if not name.endswith((_BLOCKS, _SCALES)):
            yield name, tensor, source
            continue
        stem, kind = name[:-len(_BLOCKS)], name[-len(_BLOCKS):]
        other = pending.pop(stem, None)
        if other is None:
            pending[stem] = (kind, tensor, source)
            continue
        if other[0] == kind:
            raise ValueError(f"{source}: MXFP4 tensor {name!r} appears twice")
        blocks, scales = (tensor, other[1]) if kind == _BLOCKS else (other[1], tensor)
        weight = dequantize_mxfp4(_whole(blocks), _whole(scales))
        yield stem, weight.transpose(-1, -2).contiguous(), source
    if pending:
        stem, (kind, _, source) = next(iter(pending.items()))
        missing = _SCALES if kind == _BLOCKS else _BLOCKS
        raise ValueError(f"{source}: MXFP4 tensor {stem + kind!r} has no {stem + missing!r} "
                         f"({len(pending)} unpaired)")


def _whole(tensor) -> torch.Tensor:
    """A tensor, or a lazy checkpoint slice (model/loader.LazySlice) read whole."""
    return tensor if isinstance(tensor, torch.Tensor) else tensor.load()
