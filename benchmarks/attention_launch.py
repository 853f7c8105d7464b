"""Host cost of launching attention for one layer of a mixed step (the piecewise graphs run
attention eagerly, 32 times a step for an 8B model).

A batch like the ShareGPT-like workload's mixed steps: 255 decodes at ~330 tokens of context
and one 400-token prefill chunk; Llama-3-8B's heads (32 query, 8 KV, dim 128), bf16. Each
variant is called many times without synchronising; the host time per call is what the
engine pays per layer while the GPU works. Usage: python benchmarks/attention_launch.py
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def host_us(fn, calls: int = 200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main() -> None:
    from rooflm.layers.cuda_attention import TritonBackend
    from rooflm.kernels.decode_attention import decode_attention
    from rooflm.kernels.prefill_attention import prefill_attention
    from tests.kernels.helpers import random_paged_batch

    seq_lens = [330] * 255 + [400]
    query_lens = [1] * 255 + [400]
    meta, k_cache, v_cache = random_paged_batch(seq_lens, query_lens, 8, 128, 16, torch.bfloat16, "cuda",
                                                poison_unused=False)
    q = torch.randn(sum(query_lens), 32, 128, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    backend = TritonBackend(split_span=4096)
    scale = 128 ** -0.5
    rows = [
        ("backend.attend (decode + prefill)", lambda: backend.attend(q, k_cache, v_cache, meta, scale, None, out=out)),
        ("decode_attention (255 seqs)", lambda: decode_attention(q, k_cache, v_cache, meta, scale, out=out)),
        ("prefill_attention (1 chunk)", lambda: prefill_attention(q, k_cache, v_cache, meta, scale, out=out,
                                                                   first_seq=255)),
        ("torch.add (one small op, for scale)", lambda: torch.add(q, q, out=out)),
    ]
    print(f"{'variant':<40}{'host us/call':>14}")
    for name, fn in rows:
        print(f"{name:<40}{host_us(fn):>14.1f}")


if __name__ == "__main__":
    main()
