"""GGUF's block-quantized tensors, decoded from their bytes into codes and per-block scales.

ggml stores a 2-D weight row by row, each row as blocks of 32 values:

  Q4_0  {fp16 d; uint8 qs[16]}          value = d * (q - 8),  q in 0..15   (18 B / 32 values)
  Q4_1  {fp16 d; fp16 m; uint8 qs[16]}  value = d * q + m,    q in 0..15   (20 B / 32 values)
  Q8_0  {fp16 d; int8 qs[32]}           value = d * q,        q in -128..127 (34 B / 32 values)

In the 4-bit types byte j of qs holds value j in its low nibble and value j + 16 in its high
nibble. Q4_K groups eight such sub-blocks in a super-block of 256 values (144 B, 4.5 bits a value):

  Q4_K  {fp16 d; fp16 dmin; uint8 scales[12]; uint8 qs[128]}
        sub-block i (32 values): value = (d * sc[i]) * q - (dmin * m[i]), sc and m 6-bit,
        packed in `scales` as ggml's get_scale_min_k4 reads them (i < 4: low 6 bits of bytes i
        and i + 4; i >= 4: a nibble of byte i + 4 and the top 2 bits of bytes i - 4 and i);
        qs in 4 chunks of 32 bytes, each holding sub-block 2c in the low nibbles and 2c + 1
        in the high ones (not Q4_0's j / j + 16 split).

Every block is an affine map of its codes, so all four decode to one form:

  value = scale * code + offset      (scale, offset per row and block of 32)

which is what the kernels in linear_method.py consume. Nothing here rounds: `dequantize()`
gives exactly the float values gguf's own dequantizer gives (a test checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32

# type name -> (bytes per block, has a per-block minimum m)
_LAYOUTS = {"Q4_0": (18, False), "Q4_1": (20, True), "Q8_0": (34, False)}
SUPER_BLOCK = 256  # Q4_K: values per super-block
Q4_K_BYTES = 144

FORMATS = tuple(_LAYOUTS) + ("Q4_K",)


@dataclass(frozen=True)
class BlockTensor:
    """A [rows, cols] weight as codes and per-block affine parameters.

    codes:  uint8 [rows, cols] for 4-bit formats (0..15), int8 [rows, cols] for Q8_0
    scale:  float32 [rows, cols // 32]
    offset: float32 [rows, cols // 32] (the value of code 0)
    """

    format: str
    codes: np.ndarray
    scale: np.ndarray
    offset: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def bits(self) -> int:
        return 8 if self.format == "Q8_0" else 4

    def dequantize(self) -> torch.Tensor:
        rows, cols = self.shape
        blocks = self.codes.reshape(rows, cols // BLOCK, BLOCK).astype(np.float32)
        values = blocks * self.scale[:, :, None] + self.offset[:, :, None]
        return torch.from_numpy(values.reshape(rows, cols))

    def rows(self, index: np.ndarray) -> "BlockTensor":
        """The rows in `index` order (a q/k un-permutation moves whole rows: blocks run along them)."""
        return BlockTensor(self.format, self.codes[index], self.scale[index], self.offset[index])

    @staticmethod
    def cat(parts: list["BlockTensor"]) -> "BlockTensor":
        """Row-wise concatenation of shards of one format (fused q/k/v, gate/up)."""
        formats = {p.format for p in parts}
        if len(formats) != 1:
            raise ValueError(f"cannot fuse shards of different formats {sorted(formats)}")
        return BlockTensor(parts[0].format, np.concatenate([p.codes for p in parts]),
                           np.concatenate([p.scale for p in parts]),
                           np.concatenate([p.offset for p in parts]))


def decode(format: str, raw: np.ndarray, shape: tuple[int, int]) -> BlockTensor:
    """Decode a GGUF tensor's bytes (uint8, any shape holding rows * bytes-per-row) into a
    BlockTensor of torch shape (rows, cols)."""
    if format not in FORMATS:
        raise ValueError(f"{format} is not a block format rooflm keeps quantized ({', '.join(FORMATS)})")
    rows, cols = shape
    if format == "Q4_K":
        return _decode_q4_k(raw, rows, cols)
    if cols % BLOCK:
        raise ValueError(f"row length {cols} is not a multiple of the block size {BLOCK}")
    block_bytes, has_min = _LAYOUTS[format]
    nblocks = cols // BLOCK
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if raw.size != rows * nblocks * block_bytes:
        raise ValueError(f"{format} tensor of shape {shape} needs {rows * nblocks * block_bytes} bytes, "
                         f"got {raw.size}")
    blocks = raw.reshape(rows, nblocks, block_bytes)
    scale = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float32)
    if format == "Q8_0":
        codes = blocks[:, :, 2:].copy().view(np.int8).reshape(rows, cols)
        offset = np.zeros_like(scale)
        return BlockTensor(format, codes, scale, offset)
    start = 4 if has_min else 2
    packed = blocks[:, :, start:start + 16]
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=2).reshape(rows, cols)
    if has_min:
        offset = blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float32)
    else:
        offset = -8.0 * scale
    return BlockTensor(format, codes, scale, offset)


def _decode_q4_k(raw: np.ndarray, rows: int, cols: int) -> BlockTensor:
    """Q4_K super-blocks -> per-32 (scale, offset): scale = d * sc and offset = -(dmin * m), each
    one fp32 product as ggml and gguf-py compute them, so dequantize() is theirs bit for bit."""
    if cols % SUPER_BLOCK:
        raise ValueError(f"Q4_K row length {cols} is not a multiple of the super-block size {SUPER_BLOCK}")
    supers = cols // SUPER_BLOCK
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if raw.size != rows * supers * Q4_K_BYTES:
        raise ValueError(f"Q4_K tensor of shape {(rows, cols)} needs {rows * supers * Q4_K_BYTES} bytes, "
                         f"got {raw.size}")
    blocks = raw.reshape(rows, supers, Q4_K_BYTES)
    d = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float32)
    dmin = blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float32)
    packed = blocks[:, :, 4:16]
    low, high, mixed = packed[:, :, 0:4], packed[:, :, 4:8], packed[:, :, 8:12]
    # get_scale_min_k4: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (sc) and 4-7 (m); 4-7 take a
    # nibble of bytes 8-11 and the top 2 bits of bytes 0-3 (sc) or 4-7 (m).
    sc = np.concatenate([low & 0x3F, (mixed & 0x0F) | ((low >> 6) << 4)], axis=2).astype(np.float32)
    mins = np.concatenate([high & 0x3F, (mixed >> 4) | ((high >> 6) << 4)], axis=2).astype(np.float32)
    scale = (d[:, :, None] * sc).reshape(rows, cols // BLOCK)
    offset = -(dmin[:, :, None] * mins).reshape(rows, cols // BLOCK)
    qs = blocks[:, :, 16:].reshape(rows, supers, 4, 1, 32)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(rows, cols)
    return BlockTensor("Q4_K", codes, scale, offset)
