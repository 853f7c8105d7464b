"""GGUF's block-quantized tensors, decoded from their bytes into codes and per-block scales.

ggml stores a 2-D weight row by row, each row as blocks of 32 values:

  Q4_0  {fp16 d; uint8 qs[16]}          value = d * (q - 8),  q in 0..15   (18 B / 32 values)
  Q4_1  {fp16 d; fp16 m; uint8 qs[16]}  value = d * q + m,    q in 0..15   (20 B / 32 values)
  Q8_0  {fp16 d; int8 qs[32]}           value = d * q,        q in -128..127 (34 B / 32 values)

In the 4-bit types byte j of qs holds value j in its low nibble and value j + 16 in its high
nibble. Every block is an affine map of its codes, so all three decode to one form:

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

FORMATS = tuple(_LAYOUTS)


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
    if format not in _LAYOUTS:
        raise ValueError(f"{format} is not a block format rooflm keeps quantized ({', '.join(FORMATS)})")
    rows, cols = shape
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
