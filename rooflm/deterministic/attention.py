"""The CPU's batch-invariant attention: the torch reference, one query token at a time.

The reference backend attends a prefill chunk's queries in one SDPA call and a batch of decodes
in another, and the sums of a batched call may be blocked by its shape (the tests see logprobs
move in their last bits between batchings without this mode): a token's
attention output then depends on the chunk it was computed in. Here every query token is its
own SDPA call against exactly the keys it sees, so a token gets the same numbers in a decode
step, in any prefill chunk, beside any other sequences. (On the GPU the Triton backend does the
same with its uniform prefill path: layers/cuda_attention.py.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rooflm.kernels.paged_attention_ref import gather_kv_ref
from rooflm.layers.attention import AttentionMetadata, ReferenceBackend


class RowwiseReferenceBackend(ReferenceBackend):
    name = "reference-rowwise"
    supports_softcap = False  # attend has no softcap: a soft-capped model takes the reference
    supports_sinks = False  # nor sinks (gpt-oss)

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale, sliding_window, k_scale=None,
               v_scale=None) -> torch.Tensor:
        group = q.shape[1] // k_cache.shape[2]
        out = torch.empty_like(q)
        starts = meta.query_start_loc_cpu
        for s in range(meta.num_seqs):
            seq_len = meta.seq_lens_cpu[s]
            query_len = starts[s + 1] - starts[s]
            if query_len == 0:
                continue
            # [H_kv, seq_len, D] in fp32, GQA heads expanded: each query head sees its KV head.
            k = gather_kv_ref(k_cache, meta.block_tables[s], seq_len, k_scale).transpose(0, 1)
            v = gather_kv_ref(v_cache, meta.block_tables[s], seq_len, v_scale).transpose(0, 1)
            if group > 1:
                k = k.repeat_interleave(group, dim=0)
                v = v.repeat_interleave(group, dim=0)
            for i in range(query_len):
                pos = seq_len - query_len + i
                lo = max(0, pos + 1 - sliding_window) if sliding_window else 0
                token = starts[s] + i
                qf = q[token].float()[:, None, :]  # [H, 1, D]
                # Contiguous copies: the same token then hands SDPA the same tensors (strides
                # included) whatever the length of the context gathered around it.
                keys, values = k[:, lo:pos + 1].contiguous(), v[:, lo:pos + 1].contiguous()
                o = F.scaled_dot_product_attention(qf, keys, values, scale=scale)
                out[token] = o[:, 0, :].to(q.dtype)
        return out
