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

KV cache groups (engine/kv_groups.py): where sliding-window layers hold only their window,
each group of layers has its own block tables and slot mapping over the same positions
(meta.groups); a layer reads its group's view, meta.for_group(kv_cache.group), which has its
own plan slot, so a backend plans once per group a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from rooflm.kernels.paged_attention_ref import paged_attention_ref, write_kv_ref
from rooflm.layers.kv_cache import KVCache


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
    # KV cache groups 1.. (group 0 is this metadata): the same step with each group's
    # slot_mapping and block_tables. None: one table for every layer.
    groups: Optional[list["AttentionMetadata"]] = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    def for_group(self, group: int) -> "AttentionMetadata":
        """The view of KV cache group `group`. Metadata without groups (one table for every
        layer: a step without sliding groups, the profiling pass) serves every group."""
        if group == 0 or self.groups is None:
            return self
        return self.groups[group - 1]

    def with_tables(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor) -> "AttentionMetadata":
        """This step as another KV cache group sees it: its own slots and tables, a plan of its own."""
        return AttentionMetadata(slot_mapping, self.query_start_loc, self.seq_lens, block_tables, self.max_query_len,
                                 self.max_seq_len, self.num_decodes, self.query_start_loc_cpu, self.seq_lens_cpu)


class Attention(torch.nn.Module):
    """Rotates q and k, writes this step's K/V into the paged cache, then attends through it.

    The backend (torch reference here, Triton kernels on CUDA) is chosen once
    by the model runner and passed in at construction; model code never
    branches on the device. Rotation and the cache write are one backend call
    so that a fast path can fuse them into one kernel.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, rotary,
                 sliding_window: Optional[int] = None, backend: Optional["AttentionBackend"] = None,
                 scale: Optional[float] = None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.rotary = rotary
        self.sliding_window = sliding_window
        self.backend = backend or ReferenceBackend()

    # The backend's attend options this layer always passes (SoftcappedAttention: softcap=).
    attend_options: dict = {}

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, H_kv, D] (views are fine) -> [T, H*D]. sinks: SinkAttention's."""
        k_cache, v_cache, k_scale, v_scale, group = KVCache(*kv_cache)
        meta = meta.for_group(group)
        scales = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
        q = self.backend.rope_and_write_step(q, k, v, positions, self.rotary, k_cache, v_cache, meta, **scales)
        options = self.attend_options if sinks is None else {**self.attend_options, "sinks": sinks}
        out = self.backend.attend(q, k_cache, v_cache, meta, self.scale, self.sliding_window, **options, **scales)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)


class SoftcappedAttention(Attention):
    """Attention whose scaled scores are soft-capped, softcap * tanh(s / softcap), before the
    softmax (Gemma 2). Only a backend with supports_softcap computes it; the model picks one at
    init (model/decoder.py), so a plain Attention passes the backend no option."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, rotary, softcap: float,
                 sliding_window: Optional[int] = None, backend: Optional["AttentionBackend"] = None,
                 scale: Optional[float] = None):
        super().__init__(num_heads, num_kv_heads, head_dim, rotary, sliding_window, backend, scale)
        if not self.backend.supports_softcap:
            raise ValueError(f"the {self.backend.name} attention backend cannot soft-cap attention scores")
        self.softcap = softcap
        self.attend_options = {"softcap": softcap}


class SinkAttention(Attention):
    """Attention with one learned logit per query head in each row's softmax denominator (gpt-oss's
    sinks): out = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink)). The sinks are the model's
    parameter (its checkpoint names them self_attn.sinks), handed in at each call. Only a backend
    with supports_sinks computes it; the model picks one at init (model/decoder.py) and passes
    forward its sinks=."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, rotary,
                 sliding_window: Optional[int] = None, backend: Optional["AttentionBackend"] = None,
                 scale: Optional[float] = None):
        super().__init__(num_heads, num_kv_heads, head_dim, rotary, sliding_window, backend, scale)
        if not self.backend.supports_sinks:
            raise ValueError(f"the {self.backend.name} attention backend takes no attention sinks")


class AttentionBackend:
    """The interface a fast path implements; see ReferenceBackend for the semantics.

    k_scale / v_scale are the scales of an FP8 cache, per (token, KV head) or static per KV head
    (layers/kv_cache.py), passed only when the cache is FP8: a backend without FP8 support never
    sees them.
    """

    name = "abstract"
    # Whether attend takes softcap= (attention logit soft-capping); the fused kernels do not.
    supports_softcap = False
    # Whether attend takes sinks= (a [num_heads] logit per head in the softmax denominator: gpt-oss).
    supports_sinks = False

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
    supports_softcap = True
    supports_sinks = True

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
        write_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def attend(self, q, k_cache, v_cache, meta, scale, sliding_window, k_scale=None, v_scale=None,
               softcap=None, sinks=None) -> torch.Tensor:
        return paged_attention_ref(q, k_cache, v_cache, meta, scale, sliding_window, k_scale, v_scale, softcap, sinks)
