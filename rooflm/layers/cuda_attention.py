"""The Triton attention backend: the engine's fast path behind AttentionBackend.

Same semantics as ReferenceBackend (rooflm/layers/attention.py):

* rope_and_write rotates q and k and stores k, v in their cache slots: one
  fused kernel (rope_kv_write) when the rotary module exposes its cos/sin
  table, else the base class's torch rotary followed by write_kv;
* write_kv stores this step's k, v into their cache slots (slot -1 skipped);
* attend computes causal attention of the packed queries against K/V read
  through the block tables. The model runner puts decodes (one query token)
  first: the split-KV decode kernel serves the first meta.num_decodes
  sequences and the prefill kernel the rest (prefill, chunked prefill and
  prefix-cache hits alike, since it reads all K/V from the cache). On Hopper with
  the flash-attn-4 package, the rest goes through FlashAttention-4's SM90 kernel
  instead where it takes the step (kernels/fa4_prefill.py). With
  deterministic=True every sequence, decodes included, goes through the prefill
  kernel's uniform path (batch-invariant rows; rooflm/deterministic/), the decodes
  in a launch of their own with shorter query tiles that sum alike.

The model runner picks this backend on CUDA and the reference on CPU; model
code does not change.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from rooflm.kernels.decode_attention import (DecodePlan, decode_attention, decode_config,
                                             decode_num_splits, plan_decode_attention)
from rooflm.kernels.fa4_prefill import FA4Plan, fa4_prefill, fa4_supports, plan_fa4_prefill
from rooflm.kernels.prefill_attention import (PrefillPlan, plan_prefill_attention, prefill_attention, prefill_config,
                                              uniform_decode_config)
from rooflm.kernels.rope_kv_write import rope_kv_write, write_kv
from rooflm.kernels.utils import cdiv
from rooflm.layers.attention import AttentionBackend, AttentionMetadata

log = logging.getLogger(__name__)


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_softcap = True  # the Triton kernels' SOFTCAP_LOG2 (FA4 and the FP8 MMA decode step aside)
    supports_sinks = True  # the Triton kernels' HAS_SINKS (likewise: FA4 and the FP8 MMA decode step aside)

    def __init__(self, decode_num_splits: Optional[int] = None, split_span: Optional[int] = None,
                 deterministic: bool = False, prefill_fa4: bool = False):
        # A fixed split count keeps the decode grid constant (CUDA-graph capture);
        # None sizes it per step from the batch.
        self.decode_num_splits = decode_num_splits
        # When set (the model's context length), eager steps size their splits for that span,
        # exactly as the captured graphs do, so both paths sum in the same order and give
        # bit-identical results at the captured batch sizes.
        self.split_span = split_span
        # Set only while piecewise CUDA graphs are captured (engine/piecewise_graph.py): attention
        # is then cut out of the graph, and this object records where it goes.
        self.split = None
        # --deterministic: every query row, decodes included, goes through the prefill kernel with
        # one (masked) loop over the key tiles from position 0 and one tile table entry: a token's
        # attention is summed in the same order in a decode step, a prefill chunk of any size, a
        # graph replay or eagerly, and whatever else is in the batch. No split-KV at all (the
        # split count followed the batch size), which is what it costs on long contexts.
        self.deterministic = deterministic
        # Prefill chunks through FlashAttention-4's Hopper kernel where it takes them
        # (kernels/fa4_prefill.py: fa4_enabled decides, fa4_supports per step).
        self.prefill_fa4 = prefill_fa4 and not deterministic
        self._fa4_sinks_logged = False

    def rope_and_write(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                       rotary, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, k_scale: Optional[torch.Tensor] = None,
                       v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Rotate q (in place) and k, store k and v in their slots; returns the rotated q."""
        table = getattr(rotary, "cos_sin_cache", None)
        neox = getattr(rotary, "is_neox", True)
        # A partial rotary (a table narrower than the head, Phi-4-mini) rotates in the kernel too.
        if (table is None or table.dtype != torch.float32 or table.shape[-1] > q.shape[-1]
                or (table.shape[-1] < q.shape[-1] and not neox)):
            return super().rope_and_write(q, k, v, positions, rotary, k_cache, v_cache, slot_mapping,
                                          k_scale, v_scale)
        return rope_kv_write(q, k, v, positions.long(), table, k_cache, v_cache, slot_mapping,
                             is_neox=neox, k_scale=k_scale, v_scale=v_scale)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: Optional[torch.Tensor] = None,
                 v_scale: Optional[torch.Tensor] = None) -> None:
        write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, sliding_window: Optional[int], k_scale: Optional[torch.Tensor] = None,
               v_scale: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
               softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.split is not None:
            extra = {} if sinks is None else {"sinks": sinks}
            return self.split.attend(q, k_cache, v_cache, scale, sliding_window, k_scale, v_scale, softcap, **extra)
        if out is None:
            out = torch.empty_like(q)
        # One plan per window a step: a model whose layers alternate sliding and global attention
        # (Gemma 2/3, gpt-oss) plans twice, each layer running the launches made for its own window.
        plans = meta.plan
        if plans is None:
            plans = meta.plan = {}
        plan = plans.get(sliding_window)
        if plan is None:
            plan = plans[sliding_window] = self.plan(q, k_cache, v_cache, meta, sliding_window, out, k_scale,
                                                     v_scale, softcap, sinks)
        decode, prefill = plan
        scales = dict(k_scale=k_scale, v_scale=v_scale, softcap=softcap)
        if sinks is not None:
            scales["sinks"] = sinks
        if isinstance(decode, PrefillPlan):  # --deterministic: decodes through the uniform path
            prefill_attention(q, k_cache, v_cache, meta, scale, sliding_window, out=out, plan=decode, **scales)
        elif decode is not None:
            decode_attention(q, k_cache, v_cache, meta, scale, sliding_window, out=out, plan=decode, **scales)
        if isinstance(prefill, FA4Plan):
            fa4_prefill(q, k_cache, v_cache, scale, prefill, out)
        elif prefill is not None:
            prefill_attention(q, k_cache, v_cache, meta, scale, sliding_window, out=out, plan=prefill, **scales)
        return out

    def plan(self, q, k_cache, v_cache, meta: AttentionMetadata, sliding_window: Optional[int],
             out: torch.Tensor, k_scale: Optional[torch.Tensor] = None,
             v_scale: Optional[torch.Tensor] = None,
             softcap: Optional[float] = None,
             sinks: Optional[torch.Tensor] = None) -> tuple[Optional[DecodePlan | PrefillPlan],
                                                            Optional[PrefillPlan | FA4Plan]]:
        """The step's launches, the same for every layer with this window: decodes first, then
        prefill chunks (FA4 takes no windows, soft-capping or sinks: those go through Triton)."""
        num_decodes = meta.num_decodes
        if self.deterministic:
            return self._plan_uniform(q, k_cache, v_cache, meta, sliding_window, out, k_scale, v_scale)
        decode = None
        if num_decodes > 0:
            num_splits = self.decode_num_splits
            config = None
            if self.split_span is not None:
                if num_splits is None:
                    num_splits = decode_num_splits(num_decodes, k_cache.shape[2], self.split_span, sliding_window)
                # The tile config follows the same span as the split count, as in the graphs: a
                # config that followed the batch's longest context would compile new kernel
                # variants as contexts grow, mid-serving.
                span = min(self.split_span, sliding_window) if sliding_window else self.split_span
                config = decode_config(q.shape[-1], q.dtype, cdiv(span, num_splits), fp8=k_scale is not None)
            decode = plan_decode_attention(q, k_cache, v_cache, meta, sliding_window, out=out,
                                           num_seqs=num_decodes, num_splits=num_splits, config=config,
                                           k_scale=k_scale, v_scale=v_scale)
        prefill = None
        if sinks is not None and self.prefill_fa4 and not self._fa4_sinks_logged:
            log.info("prefill attention: the Triton kernel, not FlashAttention-4 (FA4 takes no attention sinks)")
            self._fa4_sinks_logged = True
        if (num_decodes < meta.num_seqs and self.prefill_fa4 and softcap is None and sinks is None
                and fa4_supports(q, k_cache, meta, sliding_window)):
            prefill = plan_fa4_prefill(meta)
        elif num_decodes < meta.num_seqs:
            prefill = plan_prefill_attention(q, k_cache, v_cache, meta, sliding_window, out=out,
                                             first_seq=num_decodes, k_scale=k_scale, v_scale=v_scale)
        return decode, prefill

    def _plan_uniform(self, q, k_cache, v_cache, meta: AttentionMetadata, sliding_window: Optional[int],
                      out: torch.Tensor, k_scale=None, v_scale=None) -> tuple[Optional[PrefillPlan], Optional[PrefillPlan]]:
        """--deterministic: decodes and chunks both through the uniform prefill kernel, the decodes
        in tiles of fewer query rows (uniform_decode_config: same key loop, same sums)."""
        num_decodes = meta.num_decodes
        scales = dict(k_scale=k_scale, v_scale=v_scale)
        decode = prefill = None
        if num_decodes > 0:
            group = q.shape[1] // k_cache.shape[2]
            config = uniform_decode_config(prefill_config(q.shape[-1], group, q.dtype, tma=False), group)
            decode = plan_prefill_attention(q, k_cache, v_cache, meta, sliding_window, out=out, config=config,
                                            uniform=True, end_seq=num_decodes, **scales)
        if num_decodes < meta.num_seqs:
            prefill = plan_prefill_attention(q, k_cache, v_cache, meta, sliding_window, out=out,
                                             first_seq=num_decodes, uniform=True, **scales)
        return decode, prefill
