"""FlashAttention-4's Hopper forward (the `flash-attn-4` package, CuTe DSL) on rooflm's
paged cache, side by side with torch's cuDNN backend and rooflm's Triton prefill kernel.

Causal prefill, H = 32/8, D = 128, bf16. Shapes: B = 8 x S = 2048, B = 2 x S = 8192 (whole prompts),
and one chunk of 2048 queries at the end of a 16k context (chunked prefill over a cached prefix).
FLOPs: whole prompts 2 B H S^2 D (causal); a chunk of Q queries over K keys 4 H D (Q K - Q^2 / 2).
Each FA4 row reads the same paged cache (block tables, seq lens) as rooflm's kernel does, at KV
block sizes 64 and 128 (FA4 loads a 128-key tile with TMA only when a page holds exactly a tile).

Usage (GPU machine, repo root, with flash_attn.cute importable):
    python benchmarks/fa4_prefill.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import kernels as kb  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
WHOLE = ((8, 2048), (2, 8192))
CHUNK = (16384, 2048)  # context, queries at its end


def chunk_flops(context: int, queries: int) -> float:
    return 4 * HEADS * HEAD_DIM * (queries * context - queries * queries / 2)


def fa4_row(seq_lens, query_lens, block_size, flops, tile_mn=None) -> dict:
    from flash_attn.cute.interface import _flash_attn_fwd
    from rooflm.kernels.prefill_attention import prefill_attention, prefill_attention_ref
    from tests.kernels.helpers import random_paged_batch, rel_error

    meta, k_cache, v_cache = random_paged_batch(seq_lens, query_lens, KV_HEADS, HEAD_DIM, block_size,
                                                torch.bfloat16, "cuda", poison_unused=False)
    q = torch.randn(sum(query_lens), HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    ours = torch.empty_like(q)
    scale = HEAD_DIM ** -0.5
    table = meta.block_tables.to(torch.int32).contiguous()
    cu_q = meta.query_start_loc.to(torch.int32)
    used_k = meta.seq_lens.to(torch.int32)

    def fa4():
        return _flash_attn_fwd(q, k_cache, v_cache, cu_seqlens_q=cu_q, seqused_k=used_k,
                               max_seqlen_q=max(query_lens), page_table=table, softmax_scale=scale,
                               causal=True, out=out, tile_mn=tile_mn)

    def triton_fn():
        return prefill_attention(q, k_cache, v_cache, meta, scale, out=ours)

    t0 = time.perf_counter()
    fa4()
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    triton_fn()
    torch.cuda.synchronize()
    res = {"block_size": block_size, "tile_mn": tile_mn, "first_call_s": round(compile_s, 2)}
    res["fa4_ms"] = kb.bench_ms(fa4)
    res["triton_ms"] = kb.bench_ms(triton_fn)
    res["fa4_TFLOPs"] = flops / res["fa4_ms"] / 1e9
    res["triton_TFLOPs"] = flops / res["triton_ms"] / 1e9
    # Check the last sequence against the torch reference, and FA4 against the Triton kernel everywhere.
    s = len(seq_lens) - 1
    lo, hi = meta.query_start_loc_cpu[s], meta.query_start_loc_cpu[s + 1]
    one = type(meta)(slot_mapping=meta.slot_mapping[lo:hi], query_start_loc=meta.query_start_loc[:2] * 0 +
                     torch.tensor([0, hi - lo], device="cuda", dtype=meta.query_start_loc.dtype),
                     seq_lens=meta.seq_lens[s:s + 1], block_tables=meta.block_tables[s:s + 1],
                     max_query_len=hi - lo, max_seq_len=seq_lens[s], num_decodes=0,
                     query_start_loc_cpu=[0, hi - lo], seq_lens_cpu=[seq_lens[s]])
    ref = prefill_attention_ref(q[lo:hi], k_cache, v_cache, one, scale)
    res["fa4_rel_error"] = rel_error(out[lo:hi], ref)
    res["triton_rel_error"] = rel_error(ours[lo:hi], ref)
    res["fa4_vs_triton_rel_error"] = rel_error(out, ours)
    return res


def host_us(fn, calls: int = 300) -> float:
    """Host time of one call in us (no sync inside: what an eager layer costs the CPU)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt / calls * 1e6


def host_rows() -> list:
    """Launch cost per layer of each prefill path on a small mixed step (64 decodes + one 128-token
    chunk): the engine runs attention eagerly between graph pieces, once a layer."""
    from rooflm.layers.cuda_attention import TritonBackend
    from tests.kernels.helpers import random_paged_batch

    meta, k_cache, v_cache = random_paged_batch([1000] * 64 + [600], [1] * 64 + [128], KV_HEADS, HEAD_DIM, 128,
                                                torch.bfloat16, "cuda", poison_unused=False)
    q = torch.randn(meta.query_start_loc_cpu[-1], HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    rows = []
    for name, fa4 in (("triton", False), ("fa4", True)):
        backend = TritonBackend(prefill_fa4=fa4)
        out = torch.empty_like(q)

        def fn():
            return backend.attend(q, k_cache, v_cache, meta, HEAD_DIM ** -0.5, None, out=out)
        meta.plan = None
        fn()
        us = host_us(fn)
        meta.plan = None
        rows.append({"variant": f"host per layer, {name} prefill + triton decode", "host_us": us})
        print(f"host per layer (64 decodes + 128-token chunk), {name:6s} prefill: {us:6.1f} us", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = host_rows()
    cases = [(f"B={b} S={s}", [s] * b, [s] * b, kb.causal_flops(b, HEADS, s, HEAD_DIM)) for b, s in WHOLE]
    ctx, nq = CHUNK
    cases.append((f"chunk {nq} of {ctx}", [ctx], [nq], chunk_flops(ctx, nq)))
    for name, seq_lens, query_lens, flops in cases:
        if seq_lens == query_lens:
            ref = kb.sdpa_prefill(len(seq_lens), HEADS, KV_HEADS, seq_lens[0], HEAD_DIM, torch.bfloat16)
            for backend in ("flash", "cudnn"):
                r = ref.get(backend, {})
                rows.append({"shape": name, "variant": "torch " + backend, **r})
                print(f"{name:18s} torch {backend:6s} {r.get('TFLOPs', float('nan')):6.0f} TFLOP/s", flush=True)
        for block_size, tile_mn in ((64, None), (128, None), (64, (128, 64))):
            try:
                r = fa4_row(seq_lens, query_lens, block_size, flops, tile_mn)
            except Exception as e:  # noqa: BLE001 - report a variant that fails, keep the others
                r = {"block_size": block_size, "tile_mn": tile_mn, "error": f"{type(e).__name__}: {str(e)[:400]}"}
                traceback.print_exc(limit=4)
            rows.append({"shape": name, "variant": f"bs{block_size} tile {tile_mn}", **r})
            print(f"{name:18s} bs{block_size:<4d} tile {str(tile_mn):10s} FA4 {r.get('fa4_TFLOPs', float('nan')):6.0f} "
                  f"triton {r.get('triton_TFLOPs', float('nan')):6.0f} TFLOP/s  err fa4 {r.get('fa4_rel_error', float('nan')):.1e} "
                  f"triton {r.get('triton_rel_error', float('nan')):.1e}  first call {r.get('first_call_s', '-')} s "
                  f"{r.get('error', '')}", flush=True)
            torch.cuda.empty_cache()
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": kb.git_commit()}
    try:
        import flash_attn.cute as fa
        meta["flash_attn_cute"] = getattr(fa, "__version__", "?")
    except Exception:  # noqa: BLE001
        pass
    with open(os.path.join(args.out, "fa4_prefill.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
