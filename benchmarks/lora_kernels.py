"""The LoRA kernels alone at Llama-3-8B shapes: time per launch against the adapter bytes they must read.

Usage (GPU):
    PYTHONPATH=$PWD python benchmarks/lora_kernels.py [--slots 16] [--rank 16] [--batches 1 64 256]

For each of qkv, o, gate_up and down, and each batch (tokens spread round-robin over --slots
adapters, as benchmarks/lora_serving.py's mixed decode), it times the decode step's shrink and
expand (the eager mapping, the kernels a CUDA graph replays with the same tiles and splits), the
one-token GEMV with the adapter's epilogue against the plain GEMV (batch 1), and prints each
kernel's microseconds beside the floor its bytes set at --bandwidth (the adapters' A or B of the
step's distinct slots, x, y and the partial sums). The whole decode step's LoRA cost is
32 x (the four linears' shrink + expand).
"""

from __future__ import annotations

import argparse

import torch
import triton

from rooflm.kernels.gemv import gemv
from rooflm.kernels.lora_expand import lora_expand
from rooflm.kernels.lora_shrink import lora_shrink
from rooflm.layers.linear import FusedLinear, Linear
from rooflm.lora.hook import LoRALinearHook
from rooflm.lora.mapping import LoRAMapping

LINEARS = {  # name: (in, shards)
    "qkv": (4096, {"q": 4096, "k": 1024, "v": 1024}),
    "o": (4096, None),
    "gate_up": (4096, {"gate": 14336, "up": 14336}),
    "down": (14336, None),
}


def make_hook(name: str, slots: int, rank: int, mapping: LoRAMapping):
    k, shards = LINEARS[name]
    with torch.device("cuda"):
        linear = FusedLinear(k, shards) if shards else Linear(k, 4096)
    linear = linear.to(torch.bfloat16)
    torch.nn.init.normal_(linear.weight, std=k ** -0.5)
    hook = LoRALinearHook(linear, slots, rank, mapping, use_triton=True)
    hook.lora_a.normal_(std=k ** -0.5)
    hook.lora_b.normal_(std=0.05)
    return linear, hook


def bench(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, return_mode="median") * 1e3  # us


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--bandwidth", type=float, default=4.0e12, help="bytes/s for the floor column (H200: ~4.0e12)")
    args = p.parse_args(argv)
    print(f"| linear | batch | kernel | us | floor us | x floor |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    total = {}
    for batch in args.batches:
        mapping = LoRAMapping(torch.device("cuda"))
        slots = [i % args.slots for i in range(batch)]
        used = len(set(slots))
        mapping.set_step(slots, decode_only=True)
        for name in LINEARS:
            linear, hook = make_hook(name, args.slots, args.rank, mapping)
            k, out = linear.in_features, linear.out_features
            n = hook.lora_a.shape[1]
            x = torch.randn(batch, k, device="cuda", dtype=torch.bfloat16)
            y = torch.randn(batch, out, device="cuda", dtype=torch.bfloat16)
            seg = mapping.segments(args.slots)
            args_seg = (mapping.token_slots, seg.token_order, seg.seg_starts, seg.seg_slots, seg.max_seg_len, True)
            h = lora_shrink(x, hook.lora_a, *args_seg, tiles=seg.tiles)
            rows = [
                ("shrink", lambda: lora_shrink(x, hook.lora_a, *args_seg, tiles=seg.tiles),
                 used * n * k * 2 + batch * k * 2 + h.numel() * 4),
                ("expand", lambda: lora_expand(h, hook.lora_b, y, hook.shards, args.rank, *args_seg, tiles=seg.tiles),
                 used * out * args.rank * 2 + 2 * batch * out * 2 + h.numel() * 4),
            ]
            if batch == 1:
                gated = name == "gate_up"
                w = linear.weight
                epilogue = hook.gemv_epilogue(x)
                rows += [("gemv", lambda: gemv(x, w, gated=gated), w.numel() * 2),
                         ("gemv+lora", lambda: gemv(x, w, gated=gated, lora=epilogue),
                          w.numel() * 2 + out * args.rank * 2)]
            for kernel, fn, nbytes in rows:
                us = bench(fn)
                floor = nbytes / args.bandwidth * 1e6
                total[(batch, kernel)] = total.get((batch, kernel), 0.0) + us
                print(f"| {name} | {batch} | {kernel} | {us:.2f} | {floor:.2f} | {us / floor:.1f} |")
            del linear, hook, x, y, h
    for batch in args.batches:
        lora = 32 * (total[(batch, "shrink")] + total[(batch, "expand")])
        print(f"batch {batch}: the four linears' shrink + expand x 32 layers = {lora / 1e3:.3f} ms per decode step")
        if batch == 1:
            extra = 32 * (total[(1, "shrink")] + total[(1, "gemv+lora")] - total[(1, "gemv")])
            print(f"batch 1 in the GEMV chain: 32 x (shrink + gemv+lora - gemv) = {extra / 1e3:.3f} ms per step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
