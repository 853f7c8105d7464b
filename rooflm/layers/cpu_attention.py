"""The CPU attention backend: the reference math with the per-layer host work done once a step.

Why: a batch-1 decode step of a small model on a CPU is mostly host time. SmolLM2-135M has 30
layers, and the reference backend repeats per layer what is the same for all of them: the
rotary cos/sin lookup, the boolean masks of the KV write (nonzero, index_put), and for a
decode the gather of the sequence's K/V blocks, a mask over the padded context and a
repeat_interleave for GQA before SDPA's math path. Here those are worked out once per step,
in a plan kept on the step's AttentionMetadata (meta.plan, the slot the Triton backend uses
for its launch plan), and each layer does only what depends on its own tensors:

  rope:   q and k rotated together (one set of element-wise ops over H + H_kv heads), with
          the step's cos/sin;
  write:  index_copy_ of the step's K and V rows into the flattened cache (no -1 slots on
          the CPU: no CUDA-graph padding), else the reference write;
  decode: for one decoding sequence, its K/V read in place when its blocks are consecutive
          in the pool (a view, no copy; the common case, as blocks are handed out in order),
          else gathered once per layer; then one SDPA call with grouped-query heads, in fp32,
          with no mask (the view ends at the context).

Everything else (prefill chunks, several decodes) is the reference path. The math is the
reference's (fp32 scores and softmax, the same scale), so results agree to fp32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from rooflm.kernels.paged_attention_ref import write_kv_ref
from rooflm.layers.attention import AttentionMetadata, ReferenceBackend


@dataclass
class CpuStepPlan:
    """What every layer of one step shares."""

    cos: torch.Tensor  # [T, 1, D/2], in the activations' dtype, of the rotary table `table`
    sin: torch.Tensor
    all_slots_valid: bool  # no -1 in slot_mapping: index_copy_ can write the rows directly
    # One decoding sequence: its context length and, when its blocks are consecutive in the
    # pool, the first of them (K/V are then a view); None: the reference path.
    decode_len: Optional[int] = None
    first_block: Optional[int] = None
    num_blocks: int = 0
    table: Optional[torch.Tensor] = None
    # Other layers' tables (Gemma 3's local and global bases): their cos/sin, by table.
    other_tables: dict = field(default_factory=dict)

    def cos_sin(self, table: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
        if table is self.table:
            return self.cos, self.sin
        key = id(table)
        if key not in self.other_tables:
            self.other_tables[key] = _cos_sin(table, positions, dtype)
        return self.other_tables[key]


def _cos_sin(table: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    return table.index_select(0, positions).to(dtype)[:, None, :].chunk(2, dim=-1)


class CpuBackend(ReferenceBackend):
    name = "cpu"

    def rope_and_write_step(self, q, k, v, positions, rotary, k_cache, v_cache,
                            meta: AttentionMetadata, k_scale=None, v_scale=None) -> torch.Tensor:
        if k_scale is not None or not getattr(rotary, "is_neox", True):
            # FP8 caches (quantized writes) and interleaved rotary: the reference path.
            return super().rope_and_write_step(q, k, v, positions, rotary, k_cache, v_cache, meta,
                                               k_scale, v_scale)
        plan = meta.plan
        if plan is None:
            plan = meta.plan = self.plan(q, positions, rotary, k_cache, meta)
        table = getattr(rotary, "cos_sin_cache", None)
        if table is not None and table.shape[-1] == q.shape[-1]:
            q, k = self._rotate(q, k, *plan.cos_sin(table, positions, q.dtype))
        else:  # a partial rotary (Phi-3) or none (SmolLM3's NoPE layers): the module rotates
            q, k = rotary(positions, q, k)
        if plan.all_slots_valid:
            heads, dim = k_cache.shape[-2:]
            slots = meta.slot_mapping
            k_cache.view(-1, heads, dim).index_copy_(0, slots, _as(k, k_cache.dtype))
            v_cache.view(-1, heads, dim).index_copy_(0, slots, _as(v, v_cache.dtype))
        else:
            write_kv_ref(k, v, k_cache, v_cache, meta.slot_mapping)
        return q

    def attend(self, q, k_cache, v_cache, meta, scale, sliding_window, k_scale=None, v_scale=None,
               softcap=None, sinks=None) -> torch.Tensor:
        plan = meta.plan
        # Soft-capped scores (Gemma 2), sinks (gpt-oss): SDPA has neither, so the reference's math path.
        if k_scale is not None or softcap is not None or sinks is not None or not isinstance(plan, CpuStepPlan) or (
                plan.decode_len is None or (sliding_window is not None and plan.decode_len > sliding_window)):
            return super().attend(q, k_cache, v_cache, meta, scale, sliding_window, k_scale, v_scale, softcap, sinks)
        return self._single_decode(q, k_cache, v_cache, meta, plan, scale)

    @staticmethod
    def plan(q, positions, rotary, k_cache, meta: AttentionMetadata) -> CpuStepPlan:
        table = getattr(rotary, "cos_sin_cache", None)
        cos, sin = _cos_sin(table, positions, q.dtype) if table is not None else (None, None)
        # The host copies in the metadata say whether the fast paths apply; no device sync.
        slots_valid = bool((meta.slot_mapping >= 0).all()) if meta.slot_mapping.numel() else True
        plan = CpuStepPlan(cos=cos, sin=sin, all_slots_valid=slots_valid, table=table)
        if meta.num_seqs == 1 and meta.num_decodes == 1:
            block_size = k_cache.shape[1]
            seq_len = meta.seq_lens_cpu[0]
            num_blocks = -(-seq_len // block_size)
            table = meta.block_tables[0, :num_blocks].tolist()
            plan.decode_len, plan.num_blocks = seq_len, num_blocks
            if table == list(range(table[0], table[0] + num_blocks)):
                plan.first_block = table[0]
        return plan

    @staticmethod
    def _rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Neox rotary on q [T, H, D] and k [T, H_kv, D] in one pass over both."""
        heads = q.shape[1]
        qk = torch.cat([q, k], dim=1)
        half = qk.shape[-1] // 2
        x1, x2 = qk[..., :half], qk[..., half:]
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return rotated[:, :heads], rotated[:, heads:]

    @staticmethod
    def _single_decode(q, k_cache, v_cache, meta: AttentionMetadata, plan: CpuStepPlan,
                       scale: float) -> torch.Tensor:
        """One query token [1, H, D] against its sequence's decode_len cached positions."""
        heads, dim = q.shape[1], q.shape[2]
        kv_heads = k_cache.shape[2]
        length = plan.decode_len
        if plan.first_block is not None:
            blocks = slice(plan.first_block, plan.first_block + plan.num_blocks)
            k = k_cache[blocks].reshape(-1, kv_heads, dim)[:length]
            v = v_cache[blocks].reshape(-1, kv_heads, dim)[:length]
        else:
            table = meta.block_tables[0, :plan.num_blocks].long()
            k = k_cache[table].reshape(-1, kv_heads, dim)[:length]
            v = v_cache[table].reshape(-1, kv_heads, dim)[:length]
        # One fused SDPA call (torch's flash-attention CPU kernel: fp32 softmax, each K/V head
        # serving its group of consecutive query heads) on [1, H, 1, D] against [1, H_kv, L, D]
        # views: measured 35 us a layer against 93 for the two bmm's and softmax it replaces.
        out = F.scaled_dot_product_attention(_as(q, torch.float32).view(1, heads, 1, dim),
                                             _as(k, torch.float32).transpose(0, 1)[None],
                                             _as(v, torch.float32).transpose(0, 1)[None],
                                             scale=scale, enable_gqa=kv_heads != heads)
        return _as(out.view(1, heads, dim), q.dtype)


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in dtype; no dispatch when it already is (a few microseconds, times layers)."""
    return x if x.dtype == dtype else x.to(dtype)
