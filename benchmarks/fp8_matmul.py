"""FP8 W8A8 products at a decode step's and a prefill chunk's M (H100): torch._scaled_mm with
row-wise scales (torch's CUTLASS kernel, what Fp8Linear ran; also with use_fast_accum), the same
codes with per-tensor scales (cuBLAS, for scale), bf16 F.linear, and rooflm's Triton kernel
(kernels/fp8_matmul.py) in each candidate tile and in pick_config's, fast-accumulating and promoted. Llama-3-8B's four decoder shapes; each time is the median of
CUDA-graph replays over R weight copies (R x the weight > 256 MB: none is served from L2). The
error column is the Triton kernel's against the exact fp32 sum of the same codes, beside
_scaled_mm's. Usage: python benchmarks/fp8_matmul.py [--out DIR] [--batches 256,323,...]
"""

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

from quant_kernels import SHAPES, bench  # benchmarks/ is the script's directory: the same shapes and timer
from rooflm.kernels.fp8_matmul import SQUARE, WIDE, Fp8MatmulConfig, fp8_matmul, fp8_matmul_ref, pick_config
from rooflm.kernels.fp8_quant import per_token_fp8
from rooflm.kernels.utils import num_sms

CANDIDATES = [WIDE, SQUARE, Fp8MatmulConfig(128, 128, 128, 8, 8, 4), Fp8MatmulConfig(64, 128, 128, 8, 4, 6),
              Fp8MatmulConfig(128, 64, 128, 8, 4, 6)]


def rel(y, ref):
    return ((y.float() - ref).norm() / ref.norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--batches", default="256,323,512,1024,2048")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev, sms = "cuda", num_sms(0)
    rows = []
    print(f"{'shape':8} {'M':>5} | {'rowwise us':>10} {'TF/s':>5} {'err':>7} | {'fast us':>7} {'err':>7} | "
          f"{'tensorwise':>10} | {'bf16':>6} | {'triton picked':>13} {'TF/s':>5} {'err':>7} | "
          f"{'promoted':>8} {'err':>7} | best candidate")
    for name, (n, k) in SHAPES.items():
        reps = min(16, max(2, -(-256 * 2**20 // (n * k))))
        weights = []
        for _ in range(reps):
            w = torch.randn(n, k, device=dev) * 0.02
            sw = (w.abs().amax(1) / 448).float()
            weights.append(((w / sw[:, None]).to(torch.float8_e4m3fn), sw, w.to(torch.bfloat16)))
        one = torch.ones((), device=dev)
        for m in (int(b) for b in args.batches.split(",")):
            qx, sx = per_token_fp8(torch.randn(m, k, device=dev, dtype=torch.bfloat16) + 0.5)
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            flops = 2 * m * n * k
            ref = fp8_matmul_ref(qx, sx, weights[0][0], weights[0][1])
            t_row = bench(lambda q, s, _w: torch._scaled_mm(qx, q.t(), scale_a=sx, scale_b=s.reshape(1, -1),
                                                            out_dtype=torch.bfloat16), weights)
            row_err = rel(torch._scaled_mm(qx, weights[0][0].t(), scale_a=sx, scale_b=weights[0][1].reshape(1, -1),
                                           out_dtype=torch.bfloat16), ref)
            t_fast = bench(lambda q, s, _w: torch._scaled_mm(qx, q.t(), scale_a=sx, scale_b=s.reshape(1, -1),
                                                             out_dtype=torch.bfloat16, use_fast_accum=True), weights)
            fast_err = rel(torch._scaled_mm(qx, weights[0][0].t(), scale_a=sx, scale_b=weights[0][1].reshape(1, -1),
                                            out_dtype=torch.bfloat16, use_fast_accum=True), ref)
            t_ten = bench(lambda q, _s, _w: torch._scaled_mm(qx, q.t(), scale_a=one, scale_b=one,
                                                             out_dtype=torch.bfloat16), weights)
            t_bf = bench(lambda _q, _s, w: F.linear(x, w), weights)
            picked = pick_config(m, n, sms)
            cands = {}
            for cfg in CANDIDATES:
                t = bench(lambda q, s, _w: fp8_matmul(qx, sx, q, s, config=cfg), weights)
                cands[str(tuple(cfg))] = {"us": t, "err": rel(fp8_matmul(qx, sx, weights[0][0], weights[0][1],
                                                                         config=cfg), ref)}
            t_pick = cands[str(tuple(picked))]
            t_prom = bench(lambda q, s, _w: fp8_matmul(qx, sx, q, s, promote=True), weights)
            prom_err = rel(fp8_matmul(qx, sx, weights[0][0], weights[0][1], promote=True), ref)
            best = min(cands.items(), key=lambda kv: kv[1]["us"])
            rows.append(dict(shape=name, m=m, n=n, k=k, rowwise_us=t_row, rowwise_err=row_err,
                             rowwise_fast_accum_us=t_fast, rowwise_fast_accum_err=fast_err,
                             promoted_us=t_prom, promoted_err=prom_err, tensorwise_us=t_ten,
                             bf16_us=t_bf, picked=list(picked), triton=cands))
            print(f"{name:8} {m:5d} | {t_row:10.1f} {flops / t_row / 1e6:5.0f} {row_err:7.1e} | {t_fast:7.1f} "
                  f"{fast_err:7.1e} | {t_ten:10.1f} | {t_bf:6.1f} | {t_pick['us']:13.1f} "
                  f"{flops / t_pick['us'] / 1e6:5.0f} {t_pick['err']:7.1e} | {t_prom:8.1f} {prom_err:7.1e} | "
                  f"{best[0]} {best[1]['us']:.1f}", flush=True)
        del weights
        torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fp8_matmul.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                           commit=os.environ.get("ROOFLM_COMMIT", "unknown"), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
