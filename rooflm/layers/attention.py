"""Attention over the paged KV cache: metadata, the torch reference, and the layer.

Cache layout (one KVCache per layer, views into one pool; formats in layers/kv_cache.py):
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    k_scale, v_scale: [num_blocks, block_size, num_kv_heads] fp32 per token, or [num_kv_heads]
                      fp32 static, FP8 caches only (else None)
A token's slot is block_id * block_size + offset; slot_mapping gives the slot
of every token of the step (-1 for padding tokens, which are not written).

A step's batch is packed: sequence s owns query tokens
query_start_loc[s]:query_start_loc[s+1]. Its context is seq_lens[s] tokens,
the last query_len of which are this step's tokens, so query token i sits at
position seq_lens[s] - query_len + i. The model runner orders sequences with a
single query token (decodes) first: the first num_decodes sequences are
decodes and the rest are prefill chunks. Every layer gets the same metadata;
it is built once per step, never stored in a global.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from rooflm.layers.kv_cache import KVCache, dequantize_ref, has_token_scales, quantize_fp8_ref, quantize_fp8_static_ref


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = do not write
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, unused entries are 0
    max_query_len: int
    max_seq_len: int
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    # Host copies so the reference path and kernel launchers need no device sync.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # The attention backend's launch plan for this step, made at the first layer and reused by
    # the others (FlashInfer's plan/run split); None until then. It lives as long as the step.
    plan: Optional[object] = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None) -> None:
    """Store k, v [num_tokens, num_kv_heads, head_dim] into their cache slots (FP8 caches:
    quantized with one scale per token and head, stored in k_scale / v_scale, or by the
    static [num_kv_heads] scales k_scale / v_scale)."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    block_size = k_cache.shape[1]
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots % block_size
    for x, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        if scales is None:
            cache[blocks, offsets] = x[valid].to(cache.dtype)
        elif not has_token_scales(scales):
            cache[blocks, offsets] = quantize_fp8_static_ref(x[valid], scales)
        else:
            values, scale = quantize_fp8_ref(x[valid])
            cache[blocks, offsets] = values
            scales[blocks, offsets] = scale


def gather_kv_ref(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                  scales: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The first seq_len tokens of one sequence, in fp32: [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    table = block_table[:num_blocks].long()
    blocks = cache[table]  # [n, block_size, H_kv, D]
    scale = scales[table].reshape(-1, cache.shape[2])[:seq_len] if has_token_scales(scales) else scales
    return dequantize_ref(blocks.reshape(-1, *cache.shape[2:])[:seq_len], scale)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float,
                        sliding_window: Optional[int] = None, k_scale: Optional[torch.Tensor] = None,
                        v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of the packed queries against K/V read through the block tables.

    q: [num_tokens, num_heads, head_dim]; returns the same shape, in q's dtype.
    Computes in fp32. Serves decode, prefill, chunked prefill and prefix hits
    alike: the K/V of this step's tokens must already be in the cache.
    """
    num_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = meta.query_start_loc_cpu
    first = 0
    if meta.num_decodes > 1 and (sliding_window is None or meta.max_seq_len <= sliding_window):
        first = meta.num_decodes
        out[:first] = _batched_decode_ref(q[:first], k_cache, v_cache, meta, scale, group, k_scale, v_scale)
    for s in range(first, meta.num_seqs):
        seq_len = meta.seq_lens_cpu[s]
        query_len = starts[s + 1] - starts[s]
        if query_len == 0:
            continue
        # [H, q_len, D] queries against [H_kv, seq_len, D] keys and values.
        qf = q[starts[s]:starts[s + 1]].float().transpose(0, 1)
        k = gather_kv_ref(k_cache, meta.block_tables[s], seq_len, k_scale).transpose(0, 1)
        v = gather_kv_ref(v_cache, meta.block_tables[s], seq_len, v_scale).transpose(0, 1)
        if group > 1:  # GQA: each K/V head serves `group` consecutive query heads
            k = k.repeat_interleave(group, dim=0)
            v = v.repeat_interleave(group, dim=0)
        mask, causal = _causal_mask(query_len, seq_len, sliding_window, q.device)
        o = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, is_causal=causal, scale=scale)
        out[starts[s]:starts[s + 1]] = o.transpose(0, 1).to(q.dtype)
    return out


def _batched_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, group: int,
                        k_scale: Optional[torch.Tensor] = None,
                        v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """All decodes in one SDPA call: K/V gathered to the longest context, shorter ones masked."""
    n = q.shape[0]
    block_size = k_cache.shape[1]
    max_len = max(meta.seq_lens_cpu[:n])
    num_blocks = (max_len + block_size - 1) // block_size
    tables = meta.block_tables[:n, :num_blocks].long()
    # [n, num_blocks, block_size, H_kv, D] -> [n, H_kv, L, D]
    k = _gather_batched(k_cache, k_scale, tables, max_len)
    v = _gather_batched(v_cache, v_scale, tables, max_len)
    visible = torch.arange(max_len, device=q.device)[None, :] < meta.seq_lens[:n, None]
    # Slots past a sequence's end hold whatever the pool holds (stale K/V, another
    # sequence's block, uninitialised memory: possibly NaN/Inf). A masked score still
    # multiplies its V row by 0, and 0 * NaN = NaN, so zero them rather than trust the mask.
    k = k.masked_fill(~visible[:, None, :, None], 0.0)
    v = v.masked_fill(~visible[:, None, :, None], 0.0)
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    o = F.scaled_dot_product_attention(q.float()[:, :, None, :], k, v, attn_mask=visible[:, None, None, :],
                                       scale=scale)
    return o[:, :, 0, :].to(q.dtype)


def _gather_batched(cache: torch.Tensor, scales: Optional[torch.Tensor], tables: torch.Tensor,
                    max_len: int) -> torch.Tensor:
    """[n, num_blocks] block tables -> fp32 [n, H_kv, max_len, D]."""
    values = cache[tables].flatten(1, 2)[:, :max_len]
    scale = scales[tables].flatten(1, 2)[:, :max_len] if has_token_scales(scales) else scales
    return dequantize_ref(values, scale).transpose(1, 2)


def _causal_mask(query_len: int, seq_len: int, sliding_window: Optional[int], device):
    """(mask, is_causal) for queries at the last query_len positions of seq_len keys.

    The common cases need no mask tensor, which keeps the CPU path fast: a decode
    sees every key, and a prefill from position 0 is plain causal attention.
    """
    window_matters = sliding_window is not None and seq_len > sliding_window
    if not window_matters:
        if query_len == 1:
            return None, False
        if query_len == seq_len:
            return None, True
    q_pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= (q_pos - k_pos) < sliding_window
    return allowed, False


class Attention(torch.nn.Module):
    """Rotates q and k, writes this step's K/V into the paged cache, then attends through it.

    The backend (torch reference here, Triton kernels on CUDA) is chosen once
    by the model runner and passed in at construction; model code never
    branches on the device. Rotation and the cache write are one backend call
    so that a fast path can fuse them into one kernel.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, rotary,
                 sliding_window: Optional[int] = None, backend: Optional["AttentionBackend"] = None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        self.rotary = rotary
        self.sliding_window = sliding_window
        self.backend = backend or ReferenceBackend()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, H_kv, D] (views are fine) -> [T, H*D]."""
        k_cache, v_cache, k_scale, v_scale = KVCache(*kv_cache)
        scales = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
        q = self.backend.rope_and_write_step(q, k, v, positions, self.rotary, k_cache, v_cache, meta, **scales)
        out = self.backend.attend(q, k_cache, v_cache, meta, self.scale, self.sliding_window, **scales)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)


class AttentionBackend:
    """The interface a fast path implements; see ReferenceBackend for the semantics.

    k_scale / v_scale are the scales of an FP8 cache, per (token, KV head) or static per KV head
    (layers/kv_cache.py), passed only when the cache is FP8: a backend without FP8 support never
    sees them.
    """

    name = "abstract"

    def rope_and_write(self, q, k, v, positions, rotary, k_cache, v_cache, slot_mapping,
                       k_scale=None, v_scale=None) -> torch.Tensor:
        """Rotate q and k at their positions, store k and v in their slots; return rotated q."""
        q, k = rotary(positions, q, k)
        scales = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
        self.write_kv(k, v, k_cache, v_cache, slot_mapping, **scales)
        return q

    def rope_and_write_step(self, q, k, v, positions, rotary, k_cache, v_cache,
                            meta: AttentionMetadata, k_scale=None, v_scale=None) -> torch.Tensor:
        """rope_and_write with the step's metadata, for a backend that plans once a step
        (layers/cpu_attention.py); by default the same as rope_and_write."""
        scales = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
        return self.rope_and_write(q, k, v, positions, rotary, k_cache, v_cache, meta.slot_mapping, **scales)

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None,
                 v_scale=None) -> None:  # pragma: no cover
        raise NotImplementedError

    def attend(self, q, k_cache, v_cache, meta, scale, sliding_window, k_scale=None,
               v_scale=None) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError


class ReferenceBackend(AttentionBackend):
    """Pure PyTorch: the CPU path and the reference for the Triton kernels."""

    name = "reference"

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
        write_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def attend(self, q, k_cache, v_cache, meta, scale, sliding_window, k_scale=None, v_scale=None) -> torch.Tensor:
        return paged_attention_ref(q, k_cache, v_cache, meta, scale, sliding_window, k_scale, v_scale)
