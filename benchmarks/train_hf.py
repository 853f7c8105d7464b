"""An eager HF-transformers training step on a rooflm preset's shape, for `rooflm train` to stand beside.

Same recipe as rooflm's best run: fp32 master weights, bf16 autocast, SDPA attention, fused AdamW,
gradient clipping at 1.0, random token ids; MFU with the same FLOP count (rooflm.train.measure) and
the same measured matmul rate. Writes JSON and prints one line.

    python benchmarks/train_hf.py --preset llama-3.2-1b --seq-len 2048 --micro-batch 4 --out hf.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from rooflm.model.hf_config import hf_config_dict
from rooflm.model.presets import get_preset
from rooflm.perf.gpus import get_gpu, measure_gpu
from rooflm.train.measure import train_flops_per_sequence


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="llama-3.2-1b")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="torch.compile the HF model")
    p.add_argument("--gpu", default=None, help="a table GPU instead of measuring")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import transformers

    shape = get_preset(args.preset)
    fields = {k: v for k, v in hf_config_dict(shape).items() if k not in ("architectures", "model_type",
                                                                          "torch_dtype")}
    config = transformers.LlamaConfig(**fields, attn_implementation="sdpa")
    device = torch.device("cuda")
    torch.manual_seed(0)
    with device:
        model = transformers.LlamaForCausalLM(config)
    model.train()
    step_model = torch.compile(model) if args.compile else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), fused=True)

    def step():
        for _ in range(args.grad_accum):
            tokens = torch.randint(0, shape.vocab_size, (args.micro_batch, args.seq_len + 1), device=device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = step_model(input_ids=tokens[:, :-1]).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            (loss / args.grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step().item()
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    spec = get_gpu(args.gpu) if args.gpu else measure_gpu()
    flops = train_flops_per_sequence(shape, args.seq_len) * args.micro_batch * args.grad_accum
    tokens = args.seq_len * args.micro_batch * args.grad_accum
    result = {
        "what": f"HF transformers {transformers.__version__} LlamaForCausalLM "
                f"{'compiled' if args.compile else 'eager'}, sdpa, bf16 autocast, fused AdamW",
        "preset": args.preset, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
        "grad_accum": args.grad_accum, "torch": torch.__version__,
        "device": torch.cuda.get_device_name(), "step_s": step_s, "tokens_per_s": tokens / step_s,
        "mfu": flops / step_s / spec.peak_flops("bf16"), "roof_flops": spec.peak_flops("bf16"),
        "roof": spec.source, "peak_memory_bytes": torch.cuda.max_memory_allocated(), "last_loss": loss,
    }
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    print(f"{result['what']}: step {step_s * 1e3:.1f} ms, {result['tokens_per_s']:,.0f} tokens/s, "
          f"MFU {result['mfu']:.1%}, peak {result['peak_memory_bytes'] / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
