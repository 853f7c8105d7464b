"""Temperature sampling of one decode step's logits: the sampler's torch path (fp32 copy,
/ temperature, softmax, Exponential(1) draw, probs / q, argmax) against the fused Gumbel-max
kernel (kernels/gumbel_sample.py) that Sampler.forward takes for temperature-only batches on CUDA.
Llama-3's 128,256-token vocabulary, bf16 logits as the LM head writes them; median of CUDA-graph
replays, microseconds a call, and the GB/s of the logits read.
Both are Sampler.forward on the same metadata, with ROOFLM_FUSED_SAMPLING off and on.
Usage: python benchmarks/sampling.py [--out DIR] [--rows 1,64,323,512] [--vocab 128256]
"""

import argparse
import json
import os
import time

import torch
import triton

import rooflm.envs as envs
from rooflm.layers import sampler
from rooflm.sampling_params import SamplingParams


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", default="1,64,323,512")
    ap.add_argument("--vocab", type=int, default=128256)
    args = ap.parse_args()
    torch.manual_seed(0)
    results = []
    print(f"{'rows':>5} | {'torch path us':>13} | {'fused us':>8} {'GB/s':>6} | speed-up")
    for rows in (int(r) for r in args.rows.split(",")):
        logits = torch.randn(rows, args.vocab, device="cuda").to(torch.bfloat16)
        meta = sampler.SamplingMetadata.build(
            [sampler.SamplingRow(SamplingParams(temperature=0.8), [], [], None)] * rows, args.vocab, "cuda")
        times = {}
        for fused in (False, True):
            with envs.override("ROOFLM_FUSED_SAMPLING", "1" if fused else "0"):
                times[fused] = triton.testing.do_bench(lambda: sampler.Sampler()(logits, meta), rep=100) * 1e3
        t_torch, t_fused = times[False], times[True]
        gbs = rows * args.vocab * 2 / t_fused / 1e3
        results.append(dict(rows=rows, vocab=args.vocab, torch_path_us=t_torch, fused_us=t_fused, fused_GBs=gbs))
        print(f"{rows:5d} | {t_torch:13.1f} | {t_fused:8.1f} {gbs:6.0f} | {t_torch / t_fused:5.1f}x", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "sampling.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                           commit=os.environ.get("ROOFLM_COMMIT", "unknown"), rows=results), f, indent=1)


if __name__ == "__main__":
    main()
