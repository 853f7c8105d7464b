"""FP8 W8A8 products at a decode step's and a prefill chunk's M (H100): torch._scaled_mm with row-wise
scales as Fp8Linear calls it (fast accumulation, quant/fp8.py's header) and with _scaled_mm's default
promoted sums, the same codes with per-tensor scales (cuBLAS), and bf16 F.linear. Llama-3-8B's four
decoder shapes; each time is the median of CUDA-graph replays over R weight copies (R x the weight >
256 MB: none is served from L2); the errors are against the exact fp32 sum of the same codes.
Usage: python benchmarks/fp8_matmul.py [--out DIR] [--batches 256,323,...]
"""

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

from quant_kernels import SHAPES, bench  # benchmarks/ is the script's directory: the same shapes and timer
from rooflm.kernels.fp8_quant import per_token_fp8
from rooflm.quant.linear_method import fp8_matmul_emulated


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--batches", default="64,256,323,512,1024,2048")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    one = torch.ones((), device=dev)
    rows = []
    print(f"{'shape':8} {'M':>5} | {'fast us':>7} {'TF/s':>5} {'err':>7} | {'promoted us':>11} {'TF/s':>5} {'err':>7} | "
          f"{'tensorwise us':>13} | {'bf16 us':>7}")
    for name, (n, k) in SHAPES.items():
        reps = min(16, max(2, -(-256 * 2**20 // (n * k))))
        weights = []
        for _ in range(reps):
            w = torch.randn(n, k, device=dev) * 0.02
            sw = (w.abs().amax(1) / 448).float()
            weights.append(((w / sw[:, None]).to(torch.float8_e4m3fn), sw, w.to(torch.bfloat16)))
        for m in (int(b) for b in args.batches.split(",")):
            qx, sx = per_token_fp8(torch.randn(m, k, device=dev, dtype=torch.bfloat16) + 0.5)  # sums that do not cancel
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            flops = 2 * m * n * k
            ref = fp8_matmul_emulated(qx, sx, weights[0][0], weights[0][1])
            out = {}
            for fast in (True, False):
                def mm(q, s, _w, fast=fast):
                    return torch._scaled_mm(qx, q.t(), scale_a=sx, scale_b=s.reshape(1, -1), out_dtype=torch.bfloat16,
                                            use_fast_accum=fast)
                y = mm(*weights[0])
                out[fast] = (bench(mm, weights), ((y.float() - ref).norm() / ref.norm()).item())
            t_ten = bench(lambda q, _s, _w: torch._scaled_mm(qx, q.t(), scale_a=one, scale_b=one,
                                                             out_dtype=torch.bfloat16, use_fast_accum=True), weights)
            t_bf = bench(lambda _q, _s, w: F.linear(x, w), weights)
            (t_fast, e_fast), (t_prom, e_prom) = out[True], out[False]
            rows.append(dict(shape=name, m=m, n=n, k=k, fast_accum_us=t_fast, fast_accum_err=e_fast,
                             promoted_us=t_prom, promoted_err=e_prom, tensorwise_fast_us=t_ten, bf16_us=t_bf))
            print(f"{name:8} {m:5d} | {t_fast:7.1f} {flops / t_fast / 1e6:5.0f} {e_fast:7.1e} | {t_prom:11.1f} "
                  f"{flops / t_prom / 1e6:5.0f} {e_prom:7.1e} | {t_ten:13.1f} | {t_bf:7.1f}", flush=True)
        del weights
        torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fp8_matmul.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                           commit=os.environ.get("ROOFLM_COMMIT", "unknown"), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
