"""A Q4_K encoder for tests (gguf-py dequantizes Q4_K but cannot quantize it): ggml's block layout
written from the spec in rooflm/quant/gguf_blocks.py, with a plain min/max fit per sub-block (not
llama.cpp's search). Decoding is checked against gguf-py's own dequantizer, not against this."""

import numpy as np


def encode_q4_k(weights: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] (cols a multiple of 256) -> uint8 [rows, cols / 256 * 144]."""
    rows, cols = weights.shape
    supers = cols // 256
    w = weights.astype(np.float32).reshape(rows, supers, 8, 32)
    lo = np.minimum(w.min(axis=3), 0.0)  # value of code 0 is -dmin * m <= 0
    hi = w.max(axis=3)
    step = np.maximum(hi - lo, 1e-8) / 15.0
    d = (step.max(axis=2) / 63.0).astype(np.float16)
    dmin = ((-lo).max(axis=2) / 63.0).astype(np.float16)
    d32, dmin32 = d.astype(np.float32), dmin.astype(np.float32)
    safe_d = np.where(d32 > 0, d32, 1.0)[:, :, None]
    safe_dmin = np.where(dmin32 > 0, dmin32, 1.0)[:, :, None]
    sc = np.clip(np.round(step / safe_d), 1, 63).astype(np.uint8)
    m = np.clip(np.round(-lo / safe_dmin), 0, 63).astype(np.uint8)
    scale = (d32[:, :, None] * sc)[..., None]
    offset = (dmin32[:, :, None] * m)[..., None]
    q = np.clip(np.round((w + offset) / np.where(scale > 0, scale, 1.0)), 0, 15).astype(np.uint8)
    packed = np.zeros((rows, supers, 12), dtype=np.uint8)
    packed[:, :, 0:4] = (sc[:, :, :4] & 0x3F) | ((sc[:, :, 4:] >> 4) << 6)
    packed[:, :, 4:8] = (m[:, :, :4] & 0x3F) | ((m[:, :, 4:] >> 4) << 6)
    packed[:, :, 8:12] = (sc[:, :, 4:] & 0x0F) | ((m[:, :, 4:] & 0x0F) << 4)
    q = q.reshape(rows, supers, 4, 2, 32)  # chunk c: sub-block 2c low nibbles, 2c + 1 high
    qs = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(rows, supers, 128)
    out = np.concatenate([d.reshape(rows, supers, 1).view(np.uint8).reshape(rows, supers, 2),
                          dmin.reshape(rows, supers, 1).view(np.uint8).reshape(rows, supers, 2),
                          packed, qs], axis=2)
    return out.reshape(rows, supers * 144)
