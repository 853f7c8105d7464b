"""Decode attention on a fixed SM budget beside the GEMMs: the experiment overlap_probe.py named
next.

overlap_probe.py found that two streams do not overlap decode attention with the GEMMs: each
kernel's grid fills the GPU, so the second one's programs start as the first one's retire, and a
cuBLAS SM carve-out left SMs free that the attention kernel's 512 x 8 programs did not take. Here
the attention kernel is persistent: P programs loop over the (sequence, KV head) items, so it
holds at most P SMs, launched first on its own stream; the GEMMs follow on another stream, with
cuBLAS told to leave K SMs (torch._C._set_sm_carveout_experimental). Memory-bound attention on a
few SMs can still pull most of HBM if each SM keeps enough bytes in flight, and the GEMMs keep the
compute.

Rows, microseconds per layer (Llama-3-8B layer, bf16, blocks of 64, 8 layers of distinct weights):
  G                 the four GEMMs (qkv, o, gate_up, down) for T tokens, cuBLAS, all SMs
  A                 rooflm's decode attention (all SMs) for S sequences
  serial            G then A
  A_pP              the persistent attention alone on P programs
  G_cK              the GEMMs with K SMs carved out
  pair_pP_cK        A_pP on one stream (first), G_cK on another: the overlap, if any

    python benchmarks/overlap_persistent.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benchmarks.overlap_probe import (DTYPE, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, ceilings, gemm_buffers,  # noqa: E402
                                      gemms, layer_weights, sm_carveout, timed)
from rooflm.kernels.decode_attention import _decode_key_range  # noqa: E402
from rooflm.kernels.utils import LOG2E, dot_precision  # noqa: E402

BLOCK_SIZE = 64


@triton.jit
def _persistent_decode_kernel(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
                              qk_scale, num_items, stride_qt, stride_qh, stride_cb, stride_ct, stride_ch,
                              stride_bt, NUM_KV: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr,
                              HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                              DOT_PRECISION: tl.constexpr):
    offs_g = tl.arange(0, ROWS)
    g_ok = offs_g < GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    d_ok = offs_d < HEAD_DIM
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        seq = item // NUM_KV
        kv_head = item % NUM_KV
        seq_len = tl.load(seq_lens_ptr + seq)
        head = kv_head * GROUP + offs_g
        q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=g_ok[:, None], other=0.0)
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        k_base = k_cache_ptr + kv_head * stride_ch
        v_base = v_cache_ptr + kv_head * stride_ch
        m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
        full_end = (seq_len // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _decode_key_range(acc, l_i, m_i, q, k_base, v_base, k_base, v_base, table, 0, full_end,
                                          0, seq_len, qk_scale, stride_cb, stride_ct, 0, 0, offs_d, d_ok,
                                          BLOCK_SIZE, BLOCK_N, False, False, False, DOT_PRECISION, False, 0,
                                          False, HEAD_DIM)
        acc, l_i, m_i = _decode_key_range(acc, l_i, m_i, q, k_base, v_base, k_base, v_base, table, full_end,
                                          seq_len, 0, seq_len, qk_scale, stride_cb, stride_ct, 0, 0, offs_d, d_ok,
                                          BLOCK_SIZE, BLOCK_N, False, True, False, DOT_PRECISION, False, 0,
                                          False, HEAD_DIM)
        out = acc / l_i[:, None]
        tl.store(out_ptr + seq.to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


@triton.jit
def _persistent_copy_kernel(dst_ptr, src_ptr, n_chunks, CHUNK: tl.constexpr):
    offs = tl.arange(0, CHUNK)
    for c in range(tl.program_id(0), n_chunks, tl.num_programs(0)):
        base = c * CHUNK  # < 2^31 elements: int32 offsets hold
        tl.store(dst_ptr + base + offs, tl.load(src_ptr + base + offs))


@triton.jit
def _persistent_read_kernel(out_ptr, src_ptr, n_chunks, CHUNK: tl.constexpr):
    """Reads only (a sum per program, one store at the end): what attention's K/V reads need."""
    offs = tl.arange(0, CHUNK)
    acc = tl.zeros([CHUNK], dtype=tl.int32)
    for c in range(tl.program_id(0), n_chunks, tl.num_programs(0)):
        acc += tl.load(src_ptr + c * CHUNK + offs)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


def stream_rates(kernel, bytes_per_element: int, programs, warps) -> list[dict]:
    """GB/s of a streaming kernel over a 2 GiB int32 buffer on P programs of each warp count."""
    src = torch.ones(1 << 29, dtype=torch.int32, device="cuda")
    dst = torch.empty_like(src)
    chunk = 8192
    rows = []
    for w in warps:
        for p in programs:
            fn = lambda: kernel[(p,)](dst, src, src.numel() // chunk, CHUNK=chunk, num_warps=w)  # noqa: E731
            fn()
            torch.cuda.synchronize()
            gbps = bytes_per_element * src.numel() / timed(fn) / 1e6
            rows.append({"programs": p, "warps": w, "GBps": gbps, "GBps_per_program": gbps / p})
    return rows


def read_rates(programs=(8, 16, 32, 66, 132), warps=(8, 16)) -> list[dict]:
    """Reads only (bytes read, GB/s): what attention's K/V reads can get from P SMs."""
    return stream_rates(_persistent_read_kernel, 4, programs, warps)


def copy_rates(programs=(8, 16, 32, 66, 132, 264), warps=(4, 8, 16)) -> list[dict]:
    """What P programs of a plain streaming copy pull from HBM (bytes read + written, GB/s)."""
    return stream_rates(_persistent_copy_kernel, 8, programs, warps)


def attention_sets(num_seqs: int, ctx: int, seed: int):
    """(rooflm's decode attention, the persistent one on P programs) over one random paged batch."""
    from rooflm.kernels.decode_attention import decode_attention, decode_attention_ref, plan_decode_attention
    from tests.kernels.helpers import random_paged_batch

    torch.manual_seed(seed)
    meta, k, v = random_paged_batch([ctx] * num_seqs, [1] * num_seqs, KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE,
                                    "cuda", poison_unused=False)
    q = torch.randn(num_seqs, HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    out, out_p = torch.empty_like(q), torch.empty_like(q)
    plan = plan_decode_attention(q, k, v, meta)
    scale = HEAD_DIM ** -0.5

    def persistent(programs: int, config=(4, 64, 4)):
        warps, block_n, stages = config
        _persistent_decode_kernel[(programs,)](
            out_p, q, k, v, meta.block_tables, meta.seq_lens, scale * LOG2E, num_seqs * KV_HEADS,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), meta.block_tables.stride(0),
            NUM_KV=KV_HEADS, GROUP=HEADS // KV_HEADS, ROWS=16, HEAD_DIM=HEAD_DIM, BLOCK_SIZE=BLOCK_SIZE,
            BLOCK_N=block_n, DOT_PRECISION=dot_precision(DTYPE), num_warps=warps, num_stages=stages)

    def check() -> float:
        persistent(16)
        ref = decode_attention_ref(q, k, v, meta, scale)
        return float((out_p.float() - ref.float()).norm() / ref.float().norm())

    return (lambda: decode_attention(q, k, v, meta, scale, out=out, plan=plan)), persistent, check


PROGRAMS = (8, 16, 32, 66, 132)
CARVEOUTS = (0, 8, 16, 32)
# Wider programs (warps, BLOCK_N, stages) on a budget of P SMs, each paired with the GEMMs with P
# SMs carved out (--wide): a 16-warp read-only stream reads ~4x what a 4-warp attention program does.
WIDE_CONFIGS = ((4, 64, 4), (8, 64, 4), (8, 128, 3), (16, 64, 4), (16, 128, 3))
WIDE_PROGRAMS = (12, 16, 24, 32)


def run_case(name: str, tokens: int, num_seqs: int, ctx: int, copy_gbps: float, mm_tflops: float,
             wide: bool = False) -> dict:
    weights = layer_weights(LAYERS)
    buf = gemm_buffers(tokens)
    sets = [attention_sets(num_seqs, ctx, i) for i in range(LAYERS)]
    error = sets[0][2]()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    main = torch.cuda.current_stream()

    def g():
        for w in weights:
            gemms(buf["x"], w, buf)

    def a():
        for std, _, _ in sets:
            std()

    def a_p(p):
        return lambda: [pers(p) for _, pers, _ in sets]

    def pair(p):
        def fn():
            s1.wait_stream(main)
            s2.wait_stream(main)
            for w, (_, pers, _) in zip(weights, sets):
                with torch.cuda.stream(s1):
                    pers(p)
                with torch.cuda.stream(s2):
                    gemms(buf["x"], w, buf)
            main.wait_stream(s1)
            main.wait_stream(s2)
        return fn

    us = {}

    def measure(key, fn):
        fn()
        torch.cuda.synchronize()
        us[key] = timed(fn) / LAYERS * 1e3

    measure("G", g)
    measure("A", a)
    measure("serial", lambda: (g(), a()))
    if wide:
        for cfg in WIDE_CONFIGS:
            tag = "w%d_n%d_s%d" % cfg
            for p in WIDE_PROGRAMS:
                measure(f"A_p{p}_{tag}", lambda p=p, cfg=cfg: [pers(p, cfg) for _, pers, _ in sets])

                def paired(p=p, cfg=cfg):
                    s1.wait_stream(main)
                    s2.wait_stream(main)
                    for w, (_, pers, _) in zip(weights, sets):
                        with torch.cuda.stream(s1):
                            pers(p, cfg)
                        with torch.cuda.stream(s2):
                            gemms(buf["x"], w, buf)
                    main.wait_stream(s1)
                    main.wait_stream(s2)
                with sm_carveout(p):
                    measure(f"G_c{p}", g)
                    measure(f"pair_p{p}_c{p}_{tag}", paired)
        return {"case": name, "tokens": tokens, "num_seqs": num_seqs, "ctx": ctx, "persistent_rel_error": error,
                "us_per_layer": us}
    for p in PROGRAMS:
        measure(f"A_p{p}", a_p(p))
    for k in CARVEOUTS:
        with sm_carveout(k) if k else _null():
            measure(f"G_c{k}", g)
            for p in PROGRAMS:
                measure(f"pair_p{p}_c{k}", pair(p))
    kv_bytes = num_seqs * ctx * KV_HEADS * HEAD_DIM * 2 * 2
    flops = 2 * tokens * (HIDDEN * (HEADS + 2 * KV_HEADS) * HEAD_DIM + HIDDEN * HIDDEN + HIDDEN * 2 * 14336
                          + 14336 * HIDDEN)
    return {"case": name, "tokens": tokens, "num_seqs": num_seqs, "ctx": ctx, "persistent_rel_error": error,
            "kv_us_at_copy": kv_bytes / copy_gbps / 1e3, "gemm_us_at_matmul": flops / mm_tflops / 1e6,
            "us_per_layer": us}


class _null:
    def __enter__(self):
        return True

    def __exit__(self, *exc):
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--copy-only", action="store_true", help="only the streaming copy and read on P programs")
    ap.add_argument("--wide", action="store_true",
                    help="wider attention programs (WIDE_CONFIGS) on 12-32 SMs, each beside the GEMMs")
    args = ap.parse_args()
    copy_gbps, mm_tflops = ceilings()
    copies = [] if args.wide else copy_rates()
    print("| copy: programs | warps | GB/s | per program |")
    for c in copies:
        print(f"| {c['programs']} | {c['warps']} | {c['GBps']:.0f} | {c['GBps_per_program']:.1f} |")
    reads = [] if args.wide else read_rates()
    print("| read: programs | warps | GB/s read | per program |")
    for c in reads:
        print(f"| {c['programs']} | {c['warps']} | {c['GBps']:.0f} | {c['GBps_per_program']:.1f} |")
    if args.copy_only:
        return
    cases = [("mixed 1536 tok + 512 seqs x 330", 1536, 512, 330), ("mixed 2048 tok + 200 seqs x 1500", 2048, 200, 1500),
             ("decode 256 seqs x 1024", 256, 256, 1024)]
    if args.wide:
        rows = [run_case(n, t, s, c, copy_gbps, mm_tflops, wide=True) for n, t, s, c in cases[:2]]
        for r in rows:
            u = r["us_per_layer"]
            print(f"\n## {r['case']}: G {u['G']:.0f}, A {u['A']:.0f}, serial {u['serial']:.0f}")
            print("| warps, BLOCK_N, stages | " + " | ".join(f"A on {p} / pair c{p}" for p in WIDE_PROGRAMS) + " |")
            for cfg in WIDE_CONFIGS:
                tag = "w%d_n%d_s%d" % cfg
                print(f"| {cfg} | " + " | ".join(f"{u[f'A_p{p}_{tag}']:.0f} / {u[f'pair_p{p}_c{p}_{tag}']:.0f}"
                                                 for p in WIDE_PROGRAMS) + " |")
            print("| G with P carved out | " + " | ".join(f"{u[f'G_c{p}']:.0f}" for p in WIDE_PROGRAMS) + " |")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "overlap_persistent_wide.json"), "w") as f:
                json.dump({"gpu": torch.cuda.get_device_name(), "commit": os.environ.get("ROOFLM_COMMIT", "unknown"),
                           "rows": rows}, f, indent=1)
        return
    rows = [run_case(n, t, s, c, copy_gbps, mm_tflops) for n, t, s, c in cases]
    result = {"gpu": torch.cuda.get_device_name(), "copy_GBps": copy_gbps, "matmul_TFLOPs": mm_tflops,
              "persistent_copy": copies, "persistent_read": reads,
              "commit": os.environ.get("ROOFLM_COMMIT", "unknown"), "rows": rows}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "overlap_persistent.json"), "w") as f:
            json.dump(result, f, indent=1)
    print(f"copy {copy_gbps:.0f} GB/s, matmul {mm_tflops:.0f} TFLOP/s; us per layer")
    for r in rows:
        u = r["us_per_layer"]
        print(f"\n## {r['case']}: G {u['G']:.0f}, A {u['A']:.0f}, serial {u['serial']:.0f} "
              f"(floors: GEMM {r['gemm_us_at_matmul']:.0f}, KV {r['kv_us_at_copy']:.0f}); "
              f"persistent rel. error {r['persistent_rel_error']:.1e}")
        print("| P | A_pP | " + " | ".join(f"G_c{k} | pair c{k}" for k in CARVEOUTS) + " |")
        for p in PROGRAMS:
            print(f"| {p} | {u[f'A_p{p}']:.0f} | "
                  + " | ".join(f"{u[f'G_c{k}']:.0f} | {u[f'pair_p{p}_c{k}']:.0f}" for k in CARVEOUTS) + " |")


if __name__ == "__main__":
    main()
