"""FP8 W8A8 linear against bf16 F.linear on the Llama-3-8B linear shapes (GPU, sm89+).

Per shape and batch: time per call of bf16 F.linear, of torch._scaled_mm on pre-quantized
activations, and of the whole Fp8Linear (Triton per-token quant + _scaled_mm), each the median
of CUDA-graph replays over R weight copies in turn (R x the fp8 weight > 256 MB, so no copy sits
in the 50 MB L2); the relative error of Fp8Linear against the fp32 emulation of the same codes.
Usage: python benchmarks/fp8_linear.py [--out DIR]
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F

from rooflm.kernels.fp8_quant import per_token_fp8
from rooflm.quant.fp8 import quantize_fp8_weight
from rooflm.quant.linear_method import Fp8Linear, fp8_matmul_emulated
from quant_kernels import SHAPES, bench  # benchmarks/ is the script's directory: the same shapes and timer

BATCHES = (1, 16, 64, 256)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    rows = []
    print(f"{'shape':8} {'M':>4} | {'bf16 us':>8} | {'mm us':>7} | {'fp8 us':>7} {'err':>8} | fp8 speed-up")
    for name, (n, k) in SHAPES.items():
        reps = min(32, max(2, -(-256 * 2**20 // (n * k))))
        w = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(reps)]
        lins = [Fp8Linear(quantize_fp8_weight(wi), dev) for wi in w]
        for m in BATCHES:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            qx, sx = per_token_fp8(x)
            t_bf16 = bench(F.linear, [(x, wi) for wi in w])
            t_mm = bench(lambda a, s, lin: torch._scaled_mm(a, lin.qweight.t(), scale_a=s,
                                                            scale_b=lin.weight_scale.reshape(1, -1),
                                                            out_dtype=torch.bfloat16),
                         [(qx, sx, lin) for lin in lins])
            t_fp8 = bench(lambda xx, lin: lin(xx), [(x, lin) for lin in lins])
            ref = fp8_matmul_emulated(qx, sx, lins[0].qweight, lins[0].weight_scale)
            err = ((lins[0](x).float() - ref).norm() / ref.norm()).item()
            row = dict(shape=name, n=n, k=k, m=m, bf16_us=t_bf16, scaled_mm_us=t_mm, fp8_linear_us=t_fp8,
                       rel_err_vs_emulation=err, speedup=t_bf16 / t_fp8)
            rows.append(row)
            print(f"{name:8} {m:4d} | {t_bf16:8.1f} | {t_mm:7.1f} | {t_fp8:7.1f} {err:8.1e} | {t_bf16 / t_fp8:5.2f}x",
                  flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fp8_linear.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
