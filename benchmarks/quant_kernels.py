"""W4A16 / W8A16 kernels against bf16 F.linear on the Llama-3-8B linear shapes, batch 1..64 (GPU).

Prints, per shape and batch: time per call (median of CUDA-graph replays, each replay calling the
op on R weight copies in turn, R x the int4 weight > 256 MB, so no copy is still in the 50 MB L2)
and bytes moved per second (the stored format: codes + scales + zeros, plus x and y), beside the
relative error against dequantize-then-fp32. Usage: python benchmarks/quant_kernels.py [--out DIR]
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F
import triton

from tests.kernels.helpers import rel_error
from rooflm.kernels.w4a16 import pack_int4, w4a16_bytes, w4a16_linear, w4a16_linear_ref
from rooflm.kernels.w8a16 import w8a16_bytes, w8a16_linear, w8a16_linear_ref

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
BATCHES = (1, 4, 16, 32, 64)


def bench(op, copies):
    def run():
        for c in copies:
            op(*c)
    return triton.testing.do_bench_cudagraph(run, rep=50) * 1e3 / len(copies)  # us per call


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    print(f"{'shape':8} {'M':>3} | {'bf16 us':>8} {'GB/s':>6} | {'w8 us':>8} {'GB/s':>6} {'err':>7} | "
          f"{'w4g128 us':>9} {'GB/s':>6} {'err':>7} | w4 speed-up")
    for name, (n, k) in SHAPES.items():
        reps = min(32, max(2, -(-256 * 2**20 // (n * k // 2))))
        w = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(reps)]
        qw4 = [pack_int4(torch.randint(0, 16, (n, k), device="cuda", dtype=torch.uint8), 128) for _ in range(reps)]
        s4 = (torch.rand(k // 128, n, device="cuda") * 0.01 + 0.001).to(torch.bfloat16)
        z4 = torch.randint(0, 16, (k // 128, n), device="cuda").to(torch.bfloat16)
        qw8 = [torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8) for _ in range(reps)]
        s8 = (torch.rand(n, device="cuda") * 1e-3 + 1e-4).to(torch.bfloat16)
        for m in BATCHES:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_bf16 = bench(F.linear, [(x, wi) for wi in w])
            t_w8 = bench(w8a16_linear, [(x, q, s8) for q in qw8])
            t_w4 = bench(w4a16_linear, [(x, q, s4, z4, 128) for q in qw4])
            e8 = rel_error(w8a16_linear(x, qw8[0], s8), w8a16_linear_ref(x, qw8[0], s8))
            e4 = rel_error(w4a16_linear(x, qw4[0], s4, z4, 128), w4a16_linear_ref(x, qw4[0], s4, z4, 128))
            b16 = 2 * n * k + 2 * m * (n + k)
            b8, b4 = w8a16_bytes(m, n, k), w4a16_bytes(m, n, k, 128)
            row = dict(shape=name, n=n, k=k, m=m, bf16_us=t_bf16, w8_us=t_w8, w4_us=t_w4,
                       bf16_gbs=b16 / t_bf16 / 1e3, w8_gbs=b8 / t_w8 / 1e3, w4_gbs=b4 / t_w4 / 1e3,
                       w8_rel_err=e8, w4_rel_err=e4)
            rows.append(row)
            print(f"{name:8} {m:>3} | {t_bf16:8.1f} {row['bf16_gbs']:6.0f} | {t_w8:8.1f} {row['w8_gbs']:6.0f} {e8:7.1e} | "
                  f"{t_w4:9.1f} {row['w4_gbs']:6.0f} {e4:7.1e} | {t_bf16 / t_w4:.2f}x")
    sweep = sweep_gemv()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "quant_gemv_sweep.json"), "w") as f:
            json.dump(sweep, f, indent=1)
        with open(os.path.join(args.out, "quant_kernels.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


def sweep_gemv():
    """Batch-1 W4A16 tiles on the o_proj and down shapes: which (BLOCK_N, BLOCK_K, warps, stages)
    streams fastest (pick_config's choice is marked *)."""
    from rooflm.kernels.w4a16 import W4Config, pick_config
    out = []
    print("\nW4A16 batch-1 tile sweep (GB/s of the int4 weight + scales/zeros):")
    for name in ("o", "down"):
        n, k = SHAPES[name]
        reps = min(32, max(2, -(-256 * 2**20 // (n * k // 2))))
        qw = [pack_int4(torch.randint(0, 16, (n, k), device="cuda", dtype=torch.uint8), 128) for _ in range(reps)]
        s4 = (torch.rand(k // 128, n, device="cuda") * 0.01).to(torch.bfloat16)
        z4 = torch.randint(0, 16, (k // 128, n), device="cuda").to(torch.bfloat16)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        default = pick_config(1, n, k, 128)
        results = []
        for bn in (8, 16, 32):
            for bk in (256, 512):
                for warps in (4, 8):
                    for stages in (3,):
                        cfg = W4Config(1, bn, bk, warps, stages)
                        t = bench(lambda q, c=cfg: w4a16_linear(x, q, s4, z4, 128, config=c), [(q,) for q in qw])
                        results.append((w4a16_bytes(1, n, k, 128) / t / 1e3, cfg))
        results.sort(key=lambda r: -r[0])
        line = ", ".join(f"{g:.0f}{'*' if c == default else ''} (n{c.block_n} k{c.block_k} w{c.num_warps} s{c.num_stages})"
                         for g, c in results[:4])
        mine = [g for g, c in results if c == default]
        print(f"  {name:8} best: {line}; pick_config: {mine[0] if mine else float('nan'):.0f}")
        out.append(dict(shape=name, results=[dict(gbs=g, **c._asdict()) for g, c in results]))
    return out


if __name__ == "__main__":
    main()
