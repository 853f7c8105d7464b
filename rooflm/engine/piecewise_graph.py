"""Piecewise CUDA graphs for steps with prefill chunks: every layer captured, attention eager.

A mixed step (a prefill chunk beside hundreds of decodes) run eagerly launches
about 15 kernels per layer, ~500 per step for an 8B model, and the host's time
to launch them (Python, the Triton launcher, torch dispatch: ~25 ms measured on
an H100 host) is longer than the GPU's ~12 ms of work. A whole-step graph is
out of reach because attention's launch grid follows the batch (how many
sequences, how long each chunk). So the forward is cut at attention:

    piece 0: embedding, layer 0 up to its attention (norm, QKV, RoPE + KV write)
    attention 0 (eager: the real step's metadata)
    piece 1: layer 0's o_proj and MLP, layer 1 up to its attention
    ...
    piece L: layer L-1's o_proj and MLP, the final norm

Each piece is a CUDA graph per token bucket (the step's token count padded up);
everything in it depends on the token count only. Padding tokens have slot -1
(no K/V write) and no attention rows; their hidden states are ignored.

Capture runs the real model forward once per bucket with the attention backend
in "split" mode: each attend() call ends the current graph and starts the next,
and records the q tensor it was given and the output tensor the next piece
reads. Replay runs the pieces in order, and between them the real attention on
the recorded q into the recorded output. All buckets share one memory pool,
captured largest first; pieces replay in the order they were captured. What
crosses a cut (attention's q and output, the final hidden states) lives in
buffers outside the pool, shared by all layers and buckets, so the pool holds
one bucket's transient activations, not every layer's of every bucket.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch

from rooflm.layers.attention import AttentionMetadata
from rooflm.layers.kv_cache import num_kv_groups

logger = logging.getLogger(__name__)


def bucket_sizes(max_tokens: int) -> list[int]:
    """Token counts to capture: 16, then steps of 32 to 256, of 64 to 512, of 128 beyond, and
    max_tokens itself. Padding wastes at most one step of compute in the linear layers."""
    grid = [16] + list(range(32, 257, 32)) + list(range(320, 513, 64)) + list(range(640, max_tokens, 128))
    return [s for s in grid if s < max_tokens] + [max_tokens]


@dataclass
class _AttentionCall:
    """One attention between two pieces: its inputs and output live at fixed addresses."""

    q: torch.Tensor  # [T, H, D], written by the piece before
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    scale: float
    sliding_window: Optional[int]
    k_scale: Optional[torch.Tensor]  # FP8 caches' scales (layers/kv_cache.py), else None
    v_scale: Optional[torch.Tensor]
    out: torch.Tensor  # [T, H, D], read by the piece after
    softcap: Optional[float] = None  # attention logit soft-capping (Gemma 2), else None
    sinks: Optional[torch.Tensor] = None  # [H] sink logits (gpt-oss), the layer's parameter, else None


@dataclass
class _Bucket:
    pieces: list  # torch.cuda.CUDAGraph, one more than calls
    calls: list[_AttentionCall]


class _SplitAttention:
    """Handed to the backend while a bucket is captured: attend() cuts the graph there."""

    def __init__(self, pool, q: torch.Tensor, out: torch.Tensor):
        self.pool = pool
        self.q = q  # [max_tokens, H, D]: every attention's input, shared (see PiecewiseGraphRunner)
        self.out = out  # [max_tokens, H, D]: every attention's output, shared
        self.pieces: list = []
        self.calls: list[_AttentionCall] = []
        self._ctx = None

    def begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        self._ctx = torch.cuda.graph(graph, pool=self.pool)
        self._ctx.__enter__()
        self.pieces.append(graph)

    def end(self) -> None:
        self._ctx.__exit__(None, None, None)
        self._ctx = None
        if self.pool is None:  # the first piece ever captured opens the pool the rest share
            self.pool = self.pieces[-1].pool()

    def attend(self, q, k_cache, v_cache, scale, sliding_window, k_scale=None, v_scale=None,
               softcap=None, sinks=None) -> torch.Tensor:
        # q is a view of this layer's fused QKV output, in the graphs' pool: holding on to it
        # would keep every layer's QKV of every bucket allocated. One copy into the shared
        # buffer (inside the piece) lets the pool reuse it.
        t = q.shape[0]
        q_fixed = self.q[:t]
        q_fixed.copy_(q)
        self.end()
        self.calls.append(_AttentionCall(q_fixed, k_cache, v_cache, scale, sliding_window, k_scale, v_scale,
                                         self.out[:t], softcap, sinks))
        self.begin()
        return self.out[:t]


class _DummyAttention:
    """Warm-up (kernel compilation) before capture: no attention, same shapes."""

    def attend(self, q, k_cache, v_cache, scale, sliding_window, k_scale=None, v_scale=None,
               softcap=None, sinks=None) -> torch.Tensor:
        return torch.empty_like(q)


class PiecewiseGraphRunner:
    def __init__(self, model, kv_caches, backend, max_tokens: int, device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.sizes = bucket_sizes(max_tokens)
        self.max_tokens = self.sizes[-1]
        self.input_ids = torch.zeros(self.max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((self.max_tokens,), -1, dtype=torch.int64, device=device)
        # KV cache groups 1.. (engine/kv_groups.py): each group's slot mapping, read by the RoPE +
        # KV write of its layers inside the pieces; the group of each attention call, in layer
        # order, so that the eager attention between pieces reads its group's tables.
        self.group_slots = [torch.full((self.max_tokens,), -1, dtype=torch.int64, device=device)
                            for _ in range(num_kv_groups(kv_caches) - 1)]
        self.call_groups = [getattr(c, "group", 0) for c in kv_caches]
        # One attention output buffer serves every layer and bucket: piece i+1 has read layer
        # i's output (o_proj) before attention i+1 overwrites it, in stream order, and one
        # bucket runs at a time. Per layer and bucket it would take gigabytes.
        cfg = model.cfg
        dtype = model.model.embed_tokens.weight.dtype
        shape = (self.max_tokens, model.heads.num_heads, cfg.head_dim)  # this rank's heads
        self.attention_q = torch.empty(shape, dtype=dtype, device=device)
        self.attention_out = torch.empty(shape, dtype=dtype, device=device)
        self.hidden = torch.empty(self.max_tokens, cfg.hidden_size, dtype=dtype, device=device)
        self.buckets: dict[int, _Bucket] = {}
        self.pool = None

    def release(self) -> None:
        """Destroy every bucket's pieces (reset frees each graph and its hold on the pool)."""
        for bucket in self.buckets.values():
            for piece in bucket.pieces:
                piece.reset()
        self.buckets.clear()
        self.pool = None

    def bucket_size(self, num_tokens: int) -> Optional[int]:
        for size in self.sizes:
            if size >= num_tokens:
                return size
        return None

    def _capture_meta(self, t: int) -> AttentionMetadata:
        # Only slot_mapping is read inside the pieces (the RoPE + KV write); attention is cut out.
        dev = self.input_ids.device
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:t], query_start_loc=torch.tensor([0, t], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([t], dtype=torch.int32, device=dev),
            block_tables=torch.zeros(1, 1, dtype=torch.int32, device=dev), max_query_len=t, max_seq_len=t,
            num_decodes=0, query_start_loc_cpu=[0, t], seq_lens_cpu=[t])
        if self.group_slots:
            meta.groups = [meta.with_tables(slots[:t], meta.block_tables) for slots in self.group_slots]
        return meta

    @torch.inference_mode()
    def capture(self) -> float:
        t0 = time.perf_counter()
        self.slot_mapping.fill_(-1)
        for slots in self.group_slots:
            slots.fill_(-1)
        try:
            for t in reversed(self.sizes):
                meta = self._capture_meta(t)
                self.backend.split = _DummyAttention()
                self.model(self.input_ids[:t], self.positions[:t], self.kv_caches, meta)
                torch.cuda.synchronize()
                split = _SplitAttention(self.pool, self.attention_q, self.attention_out)
                self.backend.split = split
                split.begin()
                hidden = self.model(self.input_ids[:t], self.positions[:t], self.kv_caches, meta)
                self.hidden[:t].copy_(hidden)
                split.end()
                del hidden
                self.pool = split.pool
                self.buckets[t] = _Bucket(split.pieces, split.calls)
        finally:
            self.backend.split = None
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        logger.info("captured piecewise graphs for %d token buckets (%d..%d, %d pieces each) in %.1f s",
                    len(self.sizes), self.sizes[0], self.sizes[-1], len(self.buckets[self.sizes[0]].pieces),
                    elapsed)
        return elapsed

    def run(self, input_ids, positions, slot_mapping, meta: AttentionMetadata, fixup=None,
            group_slots=()) -> torch.Tensor:
        """Host tensors (pinned) of a step's tokens + the step's attention metadata on the device
        -> final hidden states [num_tokens, hidden]. fixup as in CUDAGraphRunner.run; group_slots:
        the further KV cache groups' slot mappings (host)."""
        t = input_ids.shape[0]
        size = self.bucket_size(t)
        bucket = self.buckets[size]
        self.input_ids[:t].copy_(input_ids, non_blocking=True)
        self.positions[:t].copy_(positions, non_blocking=True)
        self.slot_mapping[:t].copy_(slot_mapping, non_blocking=True)
        if t < size:  # padding tokens: position 0, no K/V write
            self.slot_mapping[t:size].fill_(-1)
            self.positions[t:size].zero_()
        for buffer, slots in zip(self.group_slots, group_slots):
            buffer[:t].copy_(slots, non_blocking=True)
            if t < size:
                buffer[t:size].fill_(-1)
        if fixup is not None:
            self.input_ids[fixup[0]] = fixup[1]
        attend = self.backend.attend
        for piece, call, group in zip(bucket.pieces, bucket.calls, self.call_groups):
            piece.replay()
            attend(call.q, call.k_cache, call.v_cache, meta.for_group(group), call.scale, call.sliding_window,
                   call.k_scale, call.v_scale, out=call.out, softcap=call.softcap,
                   **({} if call.sinks is None else {"sinks": call.sinks}))
        bucket.pieces[-1].replay()
        return self.hidden[:t]
