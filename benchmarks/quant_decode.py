"""Decode speed of the Llama-3-8B shape (dummy weights) in bf16 and weight-only int8 / int4 (GPU).

For each format, one engine (--quantization <format>: RTN of the random bf16 weights at load, the
decoder's linears and the (untied) LM head then run rooflm/kernels/w8a16.py or w4a16.py, as
gpt-fast's int8/int4 modes quantize every linear; embeddings stay bf16)
and, per batch size, B prompts of 128 random tokens: the time of a generate with 1 output token
(prefill) is subtracted from one with `out` tokens, so decode tok/s = B * (out - 1) / difference.
Beside each, the bytes one decode step must read (weights as stored + KV) and the bound they
give at the measured 3.0 TB/s (rooflm.perf.roofline with the engine's bytes per weight).

Usage: python benchmarks/quant_decode.py --formats bf16,int8,int4-g128 --batches 1,16,64 [--out DIR]
"""

import argparse
import gc
import json
import os
import time

import torch

from rooflm.llm import LLM
from rooflm.model.presets import get_preset
from rooflm.perf.gpus import get_gpu
from rooflm.perf.roofline import step_cost
from rooflm.sampling_params import SamplingParams


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(llm, prompts, out):
    params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
    sync()
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    sync()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="bf16,int8,int4-g128")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--out-b1", type=int, default=256, help="output tokens at batch 1")
    ap.add_argument("--out-batched", type=int, default=128, help="output tokens at batch > 1")
    ap.add_argument("--model", default="llama-3-8b", help="a preset (dummy weights)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    config = get_preset(args.model)
    gpu = get_gpu("h100-measured")
    rows = []
    for fmt in args.formats.split(","):
        quant = "auto" if fmt == "bf16" else fmt
        t0 = time.perf_counter()
        # A fixed pool (every sequence's 128 + 256 tokens, with room to spare) instead of 90% of the
        # device: formats follow each other in this process.
        blocks = max(batches) * -(-(args.input_len + max(args.out_b1, args.out_batched)) // 16) + 256
        llm = LLM(model=args.model, load_format="dummy", quantization=quant, max_model_len=1024,
                  max_num_seqs=max(batches), enable_prefix_caching=False, num_blocks=blocks, block_size=16)
        runner = llm.engine.runner
        wbytes, head_bytes = runner.linear_bytes_per_weight(), runner.head_bytes_per_weight()
        print(f"[{fmt}] engine ready in {time.perf_counter() - t0:.0f} s; linear bytes/weight {wbytes:.4f}, LM head {head_bytes:.4f}", flush=True)
        g = torch.Generator().manual_seed(0)
        for b in batches:
            out = args.out_b1 if b == 1 else args.out_batched
            prompts = [torch.randint(0, config.vocab_size, (args.input_len,), generator=g).tolist() for _ in range(b)]
            timed(llm, prompts, 8)  # warm-up
            t_prefill = min(timed(llm, prompts, 1) for _ in range(2))
            t_full = min(timed(llm, prompts, out) for _ in range(2))
            tps = b * (out - 1) / (t_full - t_prefill)
            # Bytes of one decode step with the engine's own bytes per linear weight (quantized
            # codes + scales + zeros), bf16 embeddings, LM head and KV.
            step = step_cost(config, num_decode_seqs=b, decode_context_tokens=b * (args.input_len + out // 2),
                             weight_bytes=wbytes, embed_bytes=2.0, head_bytes=head_bytes)
            bound = b / (step.bytes / (gpu.mem_bw_gbs * 1e9))
            row = dict(format=fmt, batch=b, input_len=args.input_len, output_len=out, decode_tok_s=tps,
                       tpot_ms=1e3 * b / tps, step_bytes=step.bytes, bound_tok_s=bound, linear_bytes_per_weight=wbytes)
            rows.append(row)
            print(f"[{fmt}] batch {b:3d}: decode {tps:8.1f} tok/s (TPOT {row['tpot_ms']:.2f} ms); step reads "
                  f"{step.bytes / 1e9:.2f} GB -> bound {bound:8.1f} tok/s ({100 * tps / bound:.0f}% of it)", flush=True)
        del llm, runner
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print("\n| format | batch | decode tok/s | TPOT ms | bytes/step GB | bound tok/s | % of bound |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['format']} | {r['batch']} | {r['decode_tok_s']:.1f} | {r['tpot_ms']:.2f} | {r['step_bytes'] / 1e9:.2f} "
              f"| {r['bound_tok_s']:.0f} | {100 * r['decode_tok_s'] / r['bound_tok_s']:.0f}% |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "quant_decode.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
