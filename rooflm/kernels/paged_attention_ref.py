"""The torch reference of attention over the paged KV cache, and of writing into it.

The decode, prefill and RoPE/KV-write kernels are checked against these functions, and the
reference attention backend (layers/attention.py: ReferenceBackend) runs them. The cache layout
and the FP8 storage formats are described in layers/attention.py and layers/kv_cache.py; `meta`
is an AttentionMetadata (layers/attention.py), read only through its fields.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

# E4M3, the FP8 format of the cache, and its largest finite value. Written here rather than taken
# from kernels/fp8_quant.py: that module defines Triton kernels, and importing it from this
# torch-only file (which layers/ imports) would compile them before a test can set TRITON_INTERPRET.
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# A head vector of zeros still gets a finite, positive scale (x / scale stays 0, never NaN).
SCALE_FLOOR = 1e-12


def has_token_scales(scale: Optional[torch.Tensor]) -> bool:
    """Whether an FP8 cache's scales are per token ([num_blocks, block_size, H_kv]); False for
    static [H_kv] scales and for caches without scales."""
    return scale is not None and scale.dim() == 3


def quantize_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (E4M3 values [..., D], fp32 scale [...]) with one scale per last-dim row."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / FP8_MAX).clamp_min(SCALE_FLOOR)
    return (xf / scale[..., None]).to(FP8_DTYPE), scale


def quantize_fp8_static_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., H_kv, D] -> E4M3 values of x / scale (scale [H_kv]), saturated at +-448."""
    return (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_ref(values: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """fp32 values of stored K or V [..., H_kv, D]: the FP8 values times their scales (one per
    token and head [..., H_kv], or static [H_kv]), or the values as they are."""
    if scale is None:
        return values.float()
    return values.float() * scale[..., None]


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
                        meta, scale: float,
                        sliding_window: Optional[int] = None, k_scale: Optional[torch.Tensor] = None,
                        v_scale: Optional[torch.Tensor] = None, softcap: Optional[float] = None,
                        sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of the packed queries against K/V read through the block tables.

    q: [num_tokens, num_heads, head_dim]; returns the same shape, in q's dtype.
    Computes in fp32. Serves decode, prefill, chunked prefill and prefix hits
    alike: the K/V of this step's tokens must already be in the cache.
    softcap: scaled scores s become softcap * tanh(s / softcap) before the softmax (Gemma 2).
    sinks: [num_heads], one logit per query head joining each row's softmax as a key without a
    value (gpt-oss): it adds exp(sink) to the denominator and nothing to the output.
    """
    num_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = meta.query_start_loc_cpu
    first = 0
    if meta.num_decodes > 1 and softcap is None and sinks is None and (sliding_window is None or meta.max_seq_len <= sliding_window):
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
        if softcap is None and sinks is None:
            o = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, is_causal=causal, scale=scale)
        else:
            o = _math_attention(qf, k, v, mask, causal, scale, softcap, sinks)
        out[starts[s]:starts[s + 1]] = o.transpose(0, 1).to(q.dtype)
    return out


def _math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                    causal: bool, scale: float, softcap: Optional[float] = None,
                    sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """SDPA's math with the scores soft-capped and/or a sink logit per head in each row's softmax:
    q [H, q_len, D], k/v [H, seq_len, D], fp32."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if causal:  # queries are the last q_len of seq_len (equal here) positions
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1), v)
    sink = sinks.float().reshape(-1, 1, 1).expand(-1, scores.shape[1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v)


def _batched_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta, scale: float, group: int,
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
