"""Integer weight-only formats in checkpoints (GPTQ, AWQ) and the one form rooflm keeps them in.

Every format decodes to one of two runtime forms, each `value = (code - zero) * scale`:

  GroupWeight  4-bit, one (scale, zero) per output row and group of `group_size` inputs:
               codes uint8 [N, K] (0..15), scales [K/g, N], zeros [K/g, N] (float, code units),
               perm: int64 [K] or None (GPTQ act-order: input k of the kernel is perm[k] of x);
               bits 8 (GGUF Q8_0, compressed-tensors int8 groups): codes int8 [N, K], W8A16's
               group-wise path. keep_dtype: the scales and zeros go to the device in their own
               dtype (GGUF: fp16 where the file's values fit it exactly, else fp32) rather than
               rounded to the activation dtype.
  ChannelWeight 8-bit, one (scale, zero) per output row: codes int8 [N, K], scales [N], zeros [N]

Checkpoint layouts (W is nn.Linear's [N = out, K = in]; all packed tensors are int32):

  GPTQ (AutoGPTQ/GPTQModel, checkpoint_format "gptq", the v1 layout vLLM and transformers read)
    qweight [K * bits / 32, N]  codes packed along K: word i of column n holds k = i*p .. i*p+p-1,
                                k = i*p + j in bits [j*bits, (j+1)*bits)      (p = 32 / bits)
    qzeros  [G, N * bits / 32]  zero points packed along N the same way, each stored MINUS ONE
    scales  [G, N] fp16;  g_idx [K] int32, the group of input k (k // g unless desc_act)
    value = scales[g_idx[k], n] * (q[k, n] - (qzeros[g_idx[k], n] + 1))
    sym=True writes zero 2^(bits-1) (stored 7 / 127 after the minus one).

  AWQ (AutoAWQ "gemm" version, 4-bit)
    qweight [K, N / 8]          codes packed along N, the 8 columns of a word in the order
                                0, 2, 4, 6, 1, 3, 5, 7 (nibble i holds column AWQ_ORDER[i])
    qzeros  [G, N / 8]          zero points, same packing, stored as they are
    scales  [G, N] fp16
    value = scales[k // g, n] * (q[k, n] - z[k // g, n])

  compressed-tensors "pack-quantized" (llm-compressor's W4A16 / W8A16, int4 or int8, group or
  channel strategy, symmetric or not; compressed_tensors' pack_to_int32)
    weight_packed      int32 [N, ceil(K * bits / 32)]  codes packed along K: word j of row n holds
                       k = j*p .. j*p+p-1, k = j*p + i in bits [i*bits, (i+1)*bits), each code the
                       signed value q (-2^(bits-1) .. 2^(bits-1)-1) stored plus 2^(bits-1)
    weight_scale       [N, G] (G = 1 for channel), the checkpoint's float dtype
    weight_zero_point  asymmetric only: int32 [ceil(N * bits / 32), G] packed along N the same
                       way (signed, stored plus 2^(bits-1)); older files: int8 [N, G] as they are
    weight_shape       [2] = (N, K);  weight_g_idx [K] with actorder "group"
    value = scale[n, g] * (q[n, k] - zero_point[n, g])  =  scale * (stored code - stored zero)

`rooflm quantize` writes GPTQ (it also holds 8-bit per-channel, group_size -1).

The W4A16 kernel's packing (rooflm/kernels/w4a16.py), made here from a GroupWeight whatever its
checkpoint (AWQ, GPTQ, RTN, rooflm quantize): pack_int4 / unpack_int4 (rooflm/kernels/int4_pack.py).
    qweight uint8 [N, S], S = int4_split(K, g) = g * ceil(K / g / 2) (K / 2 when K / g is even)
    byte j of row n: code k = j in the low nibble, code k = S + j in the high one (0 past K)
  The two halves of K sit in the two nibbles, so a tile of bytes unpacks with one mask each into
  two [rows, bytes] code tiles over contiguous K ranges, each of whole groups: no interleaving
  of nibbles to undo (a join/reshape that costs a layout conversion in the kernel).

  Fp8Weight    W8A8 (quant/fp8.py): codes float8_e4m3fn [N, K], scales fp32 [N], the activation
               scheme and a static input_scale; value = code * scale
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# How an FP8 linear's activations are quantized (quant/fp8.py): per token at run time, with a
# checkpoint's static per-tensor scale, or not at all (weight-only fp8).
FP8_ACTIVATIONS = ("dynamic", "static", "none")


@dataclass(frozen=True)
class GroupWeight:
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int
    perm: Optional[torch.Tensor] = None
    format: str = "int4"
    bits: int = 4
    keep_dtype: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """W [N, K] in fp32, in the checkpoint's input order."""
        k = self.codes.shape[1]  # the last group may be short (K not a multiple of g)
        s = self.scales.float().T.repeat_interleave(self.group_size, dim=1)[:, :k]
        z = self.zeros.float().T.repeat_interleave(self.group_size, dim=1)[:, :k]
        w = (self.codes.float() - z) * s
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    @staticmethod
    def cat(parts: list["GroupWeight"]) -> "GroupWeight":
        first = parts[0]
        for p in parts[1:]:
            if p.group_size != first.group_size or not _same_perm(p.perm, first.perm):
                raise ValueError("cannot fuse shards with different group sizes or act-order permutations")
        if len({(p.bits, p.scales.dtype, p.zeros.dtype, p.keep_dtype) for p in parts}) != 1:
            raise ValueError("cannot fuse shards with different bits or scale/zero dtypes")
        return GroupWeight(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts], dim=1),
                           torch.cat([p.zeros for p in parts], dim=1), first.group_size, first.perm, first.format,
                           first.bits, first.keep_dtype)


@dataclass(frozen=True)
class ChannelWeight:
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    format: str = "int8"
    bits: int = 8

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        return (self.codes.float() - self.zeros.float()[:, None]) * self.scales.float()[:, None]

    @staticmethod
    def cat(parts: list["ChannelWeight"]) -> "ChannelWeight":
        return ChannelWeight(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                             torch.cat([p.zeros for p in parts]), parts[0].format)


@dataclass(frozen=True)
class Fp8Weight:
    """The runtime form of an FP8 linear weight: codes float8_e4m3fn [N, K], scales fp32 [N]
    (a per-tensor scale is broadcast to the rows), input_scale fp32 scalar for static activations."""

    codes: torch.Tensor
    scales: torch.Tensor
    activations: str = "dynamic"
    input_scale: Optional[torch.Tensor] = None
    format: str = "fp8"
    bits: int = 8

    def __post_init__(self):
        if self.activations not in FP8_ACTIVATIONS:
            raise ValueError(f"fp8 activations must be one of {FP8_ACTIVATIONS}; got {self.activations!r}")
        if self.activations == "static" and self.input_scale is None:
            raise ValueError("static fp8 activations need an input_scale")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scales.float()[:, None]

    @staticmethod
    def cat(parts: list["Fp8Weight"]) -> "Fp8Weight":
        modes = {p.activations for p in parts}
        if len(modes) != 1:
            raise ValueError(f"cannot fuse fp8 shards with different activation schemes {sorted(modes)}")
        input_scale = None
        if parts[0].activations == "static":
            # One activation tensor feeds all the shards: the largest calibrated scale covers each
            # shard's range (vLLM does the same for fused q/k/v and gate/up).
            input_scale = torch.stack([p.input_scale.float().reshape(()) for p in parts]).max()
        return Fp8Weight(torch.cat([p.codes for p in parts]), torch.cat([p.scales.float() for p in parts]),
                         parts[0].activations, input_scale)


def _same_perm(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a, b)


def is_quantized_tensor(tensor) -> bool:
    from rooflm.quant.gguf_blocks import BlockTensor
    return isinstance(tensor, (BlockTensor, GroupWeight, ChannelWeight, Fp8Weight))


# ---------------------------------------------------------------------------
# Bit packing in int32 words
# ---------------------------------------------------------------------------

def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] with 32/bits codes per word along dim 0 -> int32 [R * 32/bits, C] (GPTQ qweight)."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    codes = (packed.to(torch.int32)[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    return codes.reshape(-1, packed.shape[1])


def unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] with 32/bits codes per word along dim 1 -> int32 [R, C * 32/bits] (qzeros, AWQ)."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    codes = (packed.to(torch.int32)[:, :, None] >> shifts[None, None, :]) & ((1 << bits) - 1)
    return codes.reshape(packed.shape[0], -1)


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of unpack_rows: int codes [R, C] -> int32 [R * bits / 32, C]."""
    per = 32 // bits
    c = (codes.to(torch.int64) & ((1 << bits) - 1)).reshape(-1, per, codes.shape[1])
    word = torch.zeros(c.shape[0], c.shape[2], dtype=torch.int64)
    for j in range(per):
        word |= c[:, j, :] << (j * bits)
    return _to_int32(word)


def pack_cols(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per = 32 // bits
    c = (codes.to(torch.int64) & ((1 << bits) - 1)).reshape(codes.shape[0], -1, per)
    word = torch.zeros(c.shape[0], c.shape[1], dtype=torch.int64)
    for j in range(per):
        word |= c[:, :, j] << (j * bits)
    return _to_int32(word)


def _to_int32(word: torch.Tensor) -> torch.Tensor:
    # Words with the top bit set are negative int32s (the checkpoints' dtype).
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


# ---------------------------------------------------------------------------
# Checkpoint layouts -> runtime forms
# ---------------------------------------------------------------------------

def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: Optional[torch.Tensor],
              bits: int, group_size: int, act_dtype: torch.dtype = torch.float16):
    """A GPTQ linear's tensors -> GroupWeight (4-bit) or ChannelWeight (8-bit, one group)."""
    codes = unpack_rows(qweight, bits)  # [K, N]
    k, n = codes.shape
    zeros = unpack_cols(qzeros, bits)[:, :n] + 1  # the v1 format stores zero - 1
    scales = scales.to(act_dtype)
    if bits == 8:
        if scales.shape[0] != 1:
            raise ValueError(f"GPTQ 8-bit with group_size {group_size}: rooflm's W8A16 kernel takes one "
                             f"scale per output channel (group_size -1) only")
        # Codes 0..255 around their zero point: shift both by 128 into int8 (the difference is kept).
        return ChannelWeight((codes.T - 128).to(torch.int8).contiguous(), scales[0].contiguous(),
                             (zeros[0] - 128).to(act_dtype), "gptq-int8")
    if bits != 4:
        raise ValueError(f"GPTQ bits={bits} is not supported (4 or 8)")
    g = k if group_size in (-1, 0) else group_size
    perm = None
    if g_idx is not None:
        # act-order: sort the inputs by group so each group is contiguous again; the kernel then
        # reads x through perm (one gather of the activations per call).
        perm = _act_order(g_idx, k, g)
        if perm is not None:
            codes = codes[perm]
    return GroupWeight(codes.T.to(torch.uint8).contiguous(), scales.contiguous(), zeros.to(act_dtype).contiguous(),
                       g, perm, "gptq-int4")


def _act_order(g_idx: torch.Tensor, k: int, g: int) -> Optional[torch.Tensor]:
    """None where g_idx is the plain k // g; else the permutation that sorts the inputs by group
    (GPTQ act-order), checked to give every group g inputs."""
    g_idx = g_idx.to(torch.int64)
    if torch.equal(g_idx, torch.arange(k) // g):
        return None
    counts = torch.bincount(g_idx, minlength=-(-k // g))
    if not torch.equal(counts, torch.bincount(torch.arange(k) // g)):
        raise ValueError(f"g_idx does not put {g} inputs in each group")
    return torch.argsort(g_idx, stable=True)


def from_compressed_tensors(weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_shape: torch.Tensor,
                            weight_zero_point: Optional[torch.Tensor], g_idx: Optional[torch.Tensor], bits: int,
                            group_size: int, act_dtype: torch.dtype = torch.float16):
    """A compressed-tensors pack-quantized linear (layout above) -> GroupWeight (4-bit, or 8-bit with
    groups) or ChannelWeight (8-bit per channel)."""
    if bits not in (4, 8):
        raise ValueError(f"pack-quantized num_bits={bits} is not supported (4 or 8)")
    n, k = (int(v) for v in weight_shape.reshape(-1).tolist())
    if weight_packed.dtype != torch.int32 or weight_packed.shape[0] != n or \
            weight_packed.shape[1] * 32 // bits < k:
        raise ValueError(f"weight_packed must be int32 [{n}, {-(-k * bits // 32)}] for weight_shape "
                         f"{[n, k]}, got {weight_packed.dtype} {tuple(weight_packed.shape)}")
    offset = 1 << (bits - 1)
    codes = unpack_cols(weight_packed, bits)[:, :k]  # stored, unsigned: q + offset
    scales = weight_scale.reshape(n, -1)
    groups = scales.shape[1]
    g = k if group_size in (-1, 0) or groups == 1 else group_size
    if groups != -(-k // g):
        raise ValueError(f"weight_scale {tuple(weight_scale.shape)} does not give one scale per row and "
                         f"group of {g} of K={k}")
    if weight_zero_point is None:
        zeros = torch.full((n, groups), offset, dtype=torch.int32)
    elif weight_zero_point.dtype == torch.int32:  # packed along N
        zeros = unpack_rows(weight_zero_point.reshape(-1, groups), bits)[:n]
    else:  # unpacked signed zero points (older files)
        zeros = weight_zero_point.reshape(n, groups).to(torch.int32) + offset
    perm = None if g_idx is None else _act_order(g_idx, k, g)
    if perm is not None:
        codes = codes[:, perm]
    scales = scales.T.to(act_dtype).contiguous()
    zeros = zeros.T.contiguous()
    if bits == 8:  # codes and zeros back to signed int8 (their difference is what counts)
        codes = (codes - offset).to(torch.int8).contiguous()
        zeros = (zeros - offset).to(act_dtype)
        if groups == 1 and perm is None:
            return ChannelWeight(codes, scales[0].contiguous(), zeros[0].contiguous(), "ct-int8")
        return GroupWeight(codes, scales, zeros, g, perm, "ct-int8", bits=8)
    return GroupWeight(codes.to(torch.uint8).contiguous(), scales, zeros.to(act_dtype), g, perm, "ct-int4")


def _narrowest(values: np.ndarray) -> np.ndarray:
    """fp16 if it holds every value exactly, else fp32 (contiguous)."""
    half = values.astype(np.float16)
    exact = np.array_equal(half.astype(np.float32), values)
    return np.ascontiguousarray(half if exact else values.astype(np.float32))


def from_gguf_blocks(blocks) -> GroupWeight:
    """A GGUF weight (gguf_blocks.BlockTensor) in the form the CUDA kernels take: groups of 32,
    value = (code - zero) * scale; W4A16 for the 4-bit types, W8A16's group-wise path for Q8_0.
    The same values:

      Q4_0  scale d, zero 8                    Q8_0  scale d, zero 0 (int8 codes)
      Q4_1  scale d, zero -m / d               Q4_K  scale d * sc, zero dmin * m / (d * sc)

    Scales and zeros are kept in fp16 where fp16 holds every one exactly (d of Q4_0/Q4_1/Q8_0 is
    the file's fp16; zero 8 is exact), else in fp32 (Q4_K's d * sc has up to 17 significant
    bits; -m / d is a quotient): keep_dtype stops the linear from rounding them to the
    activation dtype. Only the fp32 quotient rounds (relative 2^-24 of m). A block with scale 0
    is the constant `offset`, which (code - zero) * 0 cannot give: its codes become 0 and its
    (scale, zero) (|offset|, -sign(offset)), the same values."""
    from rooflm.quant.gguf_blocks import BLOCK
    scale = blocks.scale.astype(np.float32)
    offset = blocks.offset.astype(np.float32)
    codes = blocks.codes
    dead = scale == 0
    if dead.any():
        codes = codes.reshape(*scale.shape, BLOCK).copy()
        codes[dead] = 0
        codes = codes.reshape(blocks.shape)
        scale = np.where(dead, np.abs(offset), scale)
    with np.errstate(divide="ignore", invalid="ignore"):
        # (Q4_0's d is negative where its block's largest |w| is negative: a sign is no special case)
        zero = np.where(scale != 0, -offset / np.where(scale != 0, scale, 1.0), 0.0).astype(np.float32)
    if blocks.format == "Q8_0":
        zero = np.zeros_like(scale)  # symmetric: the W8A16 linear drops the zero term
    return GroupWeight(torch.from_numpy(np.ascontiguousarray(codes)),
                       torch.from_numpy(_narrowest(scale.T)), torch.from_numpy(_narrowest(zero.T)),
                       BLOCK, None, f"gguf-{blocks.format.lower()}", blocks.bits, keep_dtype=True)


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
             act_dtype: torch.dtype = torch.float16) -> GroupWeight:
    order = torch.tensor(AWQ_ORDER)
    inverse = torch.argsort(order)  # column c of a word sits in nibble inverse[c]

    def unpack(packed):
        nibbles = unpack_cols(packed, 4).reshape(packed.shape[0], -1, 8)
        return nibbles[:, :, inverse].reshape(packed.shape[0], -1)

    codes = unpack(qweight)  # [K, N]
    zeros = unpack(qzeros)
    return GroupWeight(codes.T.to(torch.uint8).contiguous(), scales.to(act_dtype).contiguous(),
                       zeros.to(act_dtype).contiguous(), group_size, None, "awq-int4")


def to_awq(weight: GroupWeight) -> dict[str, torch.Tensor]:
    """AWQ tensors of a GroupWeight (tests build AWQ checkpoints with it)."""
    order = torch.tensor(AWQ_ORDER)

    def pack(codes):  # [R, C] -> [R, C / 8], nibble i holding column order[i] of each 8
        grouped = codes.reshape(codes.shape[0], -1, 8)[:, :, order].reshape(codes.shape[0], -1)
        return pack_cols(grouped, 4)

    return {"qweight": pack(weight.codes.T.to(torch.int32)), "qzeros": pack(weight.zeros.round().to(torch.int32)),
            "scales": weight.scales.to(torch.float16)}


def to_gptq(weight, bits: int) -> dict[str, torch.Tensor]:
    """GPTQ v1 tensors of a GroupWeight (bits 4, act-order as g_idx) or ChannelWeight (bits 8)."""
    if bits == 8:
        codes = weight.codes.to(torch.int32).T + 128  # [K, N], 0..255
        zeros = (weight.zeros.float().round().to(torch.int32) + 128)[None, :]
        scales = weight.scales[None, :]
        g_idx = torch.zeros(codes.shape[0], dtype=torch.int32)
    else:
        codes = weight.codes.to(torch.int32).T  # [K, N] in the kernel's (group-sorted) order
        zeros = weight.zeros.float().round().to(torch.int32)
        scales = weight.scales
        g_idx = (torch.arange(codes.shape[0]) // weight.group_size).to(torch.int32)
        if weight.perm is not None:  # act-order: back to the input order, groups named by g_idx
            original = torch.empty_like(codes)
            original[weight.perm] = codes
            codes = original
            order = torch.empty_like(g_idx)
            order[weight.perm] = g_idx
            g_idx = order
    return {"qweight": pack_rows(codes, bits), "qzeros": pack_cols(zeros - 1, bits),
            "scales": scales.to(torch.float16).contiguous(), "g_idx": g_idx}
