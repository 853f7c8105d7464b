"""The fused MoE layer (rooflm/kernels/fused_moe.py) at real model shapes, beside its bandwidth
floor and the per-expert loop of torch matmuls it replaces.

Shapes: Qwen3-30B-A3B (E=128, top_k=8, H=2048, I=768) and Mixtral-8x7B (E=8, top_k=2, H=4096,
I=14336), bf16, batch 1..1024. Routing: top-k of random logits (uniform in expectation).

Each case is timed as a decode step runs it: a CUDA graph that calls the layer on L layers'
different weights back to back (so no layer's experts are still in L2), replayed R times
between two CUDA events; time per layer = total / (R * L). The naive loop syncs the host once
per call (it reads the per-expert counts) and cannot be captured, so it is timed eagerly, and
the fused path eagerly too for a like-for-like number.

Bytes count the experts this routing actually touched (distinct ids), once each, plus the
activations (fused_moe_bytes); floor = max(bytes / HBM bandwidth, FLOPs / peak bf16). Printed:
us per layer, the floor, % of floor, GB/s, TFLOP/s, the speedup over the loop (issue 48's
targets at Qwen3's shape: >= 1.5x at batch 1, >= 3x at batch 64), and moe_align's share.

The whole routed layer, as SparseMoeBlock runs it on CUDA, in one graph over L layers:
  layer      router matmul + moe_router (one launch) + moe_align_block_size_triton (one launch)
             + the two grouped GEMMs + the sum: the Kernels path of rooflm/layers/moe.py
  layer_old  router matmul + torch's fp32 softmax / topk / renormalise + the torch align (about
             a dozen launches) + the same GEMMs: what the path was before the one-launch kernels
and both aligns alone (align_triton_us, align_torch_us). --fp8 adds the FP8 W8A8 experts
(E4M3 codes, per-channel scales, per-token activations: two quantize launches more) at each
batch, with its floor from one-byte weights (issue 48: FP8 experts >= 1.4x bf16 offline).
--int4 adds int4 weight-only experts (round to nearest, group 128, bf16 scales and zeros: a GPTQ
checkpoint's layout as Experts keeps it) with their floor from half-byte weights.

    python benchmarks/moe_kernel.py OUT.json [--layers 4] [--batches 1,2,4,...] [--shape qwen3-30b-a3b] [--gpu h200] [--fp8] [--int4]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from rooflm.kernels.fused_moe import fused_moe, fused_moe_bytes, fused_moe_flops, pick_config  # noqa: E402
from rooflm.kernels.moe_align import moe_align_block_size, moe_align_block_size_triton  # noqa: E402
from rooflm.kernels.moe_router import moe_router  # noqa: E402
from rooflm.kernels.int4_pack import pack_int4  # noqa: E402
from rooflm.quant.fp8 import quantize_fp8_experts  # noqa: E402
from rooflm.quant.rtn import rtn_int4  # noqa: E402
from rooflm.layers.activation import silu_and_mul_torch  # noqa: E402
from rooflm.layers.moe import experts_torch  # noqa: E402
from rooflm.perf.gpus import get_gpu  # noqa: E402

SHAPES = {
    "qwen3-30b-a3b": dict(num_experts=128, top_k=8, hidden=2048, inter=768),
    "mixtral-8x7b": dict(num_experts=8, top_k=2, hidden=4096, inter=14336),
}
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


def time_graph(fn, reps: int = 20) -> float:
    """Seconds per replay of a CUDA graph of fn(), best of three rounds."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _best_of(graph.replay, reps)


def time_eager(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    return _best_of(fn, reps)


def _best_of(fn, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / reps)
    return best


def routing(num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator):
    logits = torch.randn(num_tokens, num_experts, generator=gen, device="cuda")
    top, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return (top / top.sum(-1, keepdim=True)), ids


def routed_layer(x, router_w, w13, w2, top_k, new: bool, **fp8):
    """One MoE layer as SparseMoeBlock runs it: the router matmul, the routing, the experts."""
    logits = x @ router_w.T
    if new:
        weights, ids = moe_router(logits, top_k, "softmax", True)
        return fused_moe(x, w13, w2, weights, ids, align=moe_align_block_size_triton, **fp8)
    top, ids = torch.softmax(logits.float(), -1).topk(top_k, dim=-1)
    return fused_moe(x, w13, w2, top / top.sum(-1, keepdim=True), ids, align=moe_align_block_size, **fp8)


INT4_GROUP = 128


def int4_experts(w: torch.Tensor) -> dict:
    """Float experts [E, N, K] -> the int4 kernel's packed codes and [E, K/g, N] scales / zeros."""
    qs = [rtn_int4(expert, INT4_GROUP) for expert in w]
    return dict(codes=torch.stack([pack_int4(q.codes, INT4_GROUP) for q in qs]),
                scales=torch.stack([q.scales.to(w.dtype) for q in qs]),
                zeros=torch.stack([q.zeros.to(w.dtype) for q in qs]))


def bench_shape(name: str, shape: dict, batches: list[int], layers: int, bw: float, peak: float,
                fp8: bool = False, int4: bool = False) -> list[dict]:
    e, k, h, i = shape["num_experts"], shape["top_k"], shape["hidden"], shape["inter"]
    dt = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = [torch.randn(e, 2 * i, h, device="cuda", dtype=dt, generator=gen) * 0.02 for _ in range(layers)]
    w2 = [torch.randn(e, h, i, device="cuda", dtype=dt, generator=gen) * 0.02 for _ in range(layers)]
    router_w = [torch.randn(e, h, device="cuda", dtype=dt, generator=gen) * 0.02 for _ in range(layers)]
    q13 = [quantize_fp8_experts(w) for w in w13] if fp8 else []
    q2 = [quantize_fp8_experts(w) for w in w2] if fp8 else []
    i13 = [int4_experts(w) for w in w13] if int4 else []
    i2 = [int4_experts(w) for w in w2] if int4 else []
    rows = []
    for t in batches:
        x = torch.randn(t, h, device="cuda", dtype=dt, generator=gen)
        weights, ids = routing(t, e, k, gen)
        active = ids.unique().numel()
        nbytes = fused_moe_bytes(t, active, k, h, i, 2)
        flops = fused_moe_flops(t, k, h, i)
        floor = max(nbytes / bw, flops / peak)
        cfg = pick_config(t, e, k, h, i, x.device)

        fused_graph = time_graph(lambda: [fused_moe(x, a, b, weights, ids) for a, b in zip(w13, w2)]) / layers
        fused_eager = time_eager(lambda: [fused_moe(x, a, b, weights, ids) for a, b in zip(w13, w2)]) / layers
        align = time_graph(lambda: moe_align_block_size(ids, cfg.block_m, e))
        align_triton = time_graph(lambda: moe_align_block_size_triton(ids, cfg.block_m, e))
        layer = time_graph(lambda: [routed_layer(x, r, a, b, k, True) for r, a, b in zip(router_w, w13, w2)]) / layers
        layer_old = time_graph(lambda: [routed_layer(x, r, a, b, k, False)
                                        for r, a, b in zip(router_w, w13, w2)]) / layers
        naive = time_eager(lambda: [experts_torch(x, a, b, weights, ids, silu_and_mul_torch)
                                    for a, b in zip(w13, w2)]) / layers
        row = dict(shape=name, batch=t, active_experts=active, bytes=nbytes, flops=flops,
                   floor_us=floor * 1e6, fused_graph_us=fused_graph * 1e6, fused_eager_us=fused_eager * 1e6,
                   align_us=align * 1e6, align_torch_us=align * 1e6, align_triton_us=align_triton * 1e6,
                   layer_us=layer * 1e6, layer_old_us=layer_old * 1e6, naive_eager_us=naive * 1e6,
                   pct_of_floor=100 * floor / fused_graph, gb_s=nbytes / fused_graph / 1e9,
                   tflop_s=flops / fused_graph / 1e12, speedup_vs_naive=naive / fused_graph,
                   speedup_eager_vs_naive=naive / fused_eager, config=cfg.to_dict())
        line = (f"{name:14s} T={t:5d} experts {active:3d}  {nbytes / 1e6:8.1f} MB  floor {floor * 1e6:7.1f} us  "
                f"fused {fused_graph * 1e6:7.1f} us ({row['pct_of_floor']:5.1f}% of floor, {row['gb_s']:6.0f} GB/s, "
                f"{row['tflop_s']:6.1f} TFLOP/s)  eager {fused_eager * 1e6:7.1f}  align torch {align * 1e6:5.1f} "
                f"triton {align_triton * 1e6:5.1f}  layer {layer * 1e6:7.1f} (was {layer_old * 1e6:7.1f})  "
                f"naive {naive * 1e6:8.1f} us  x{row['speedup_vs_naive']:.2f}")
        if fp8:
            fp8_bytes = fused_moe_bytes(t, active, k, h, i, 2, fp8=True)
            fp8_floor = max(fp8_bytes / bw, flops / (2 * peak))
            fp8_layer = time_graph(lambda: [
                routed_layer(x, r, a[0], b[0], k, True, w13_scale=a[1], w2_scale=b[1])
                for r, a, b in zip(router_w, q13, q2)]) / layers
            fp8_experts = time_graph(lambda: [fused_moe(x, a[0], b[0], weights, ids, w13_scale=a[1], w2_scale=b[1])
                                              for a, b in zip(q13, q2)]) / layers
            row.update(fp8_bytes=fp8_bytes, fp8_floor_us=fp8_floor * 1e6, fp8_graph_us=fp8_experts * 1e6,
                       fp8_layer_us=fp8_layer * 1e6, fp8_pct_of_floor=100 * fp8_floor / fp8_experts,
                       fp8_speedup_vs_bf16=fused_graph / fp8_experts)
            line += (f"\n{'':14s} fp8 experts {fp8_experts * 1e6:7.1f} us (floor {fp8_floor * 1e6:7.1f}, "
                     f"{row['fp8_pct_of_floor']:5.1f}%; x{row['fp8_speedup_vs_bf16']:.2f} bf16)  "
                     f"fp8 layer {fp8_layer * 1e6:7.1f} us")
        if int4:
            weight_bytes = active * 3 * h * i
            int4_bytes = nbytes - 2 * weight_bytes + weight_bytes * (0.5 + 2 * 2 / INT4_GROUP)
            int4_floor = max(int4_bytes / bw, flops / peak)
            int4_experts_s = time_graph(lambda: [
                fused_moe(x, a["codes"], b["codes"], weights, ids, w13_scale=a["scales"], w2_scale=b["scales"],
                          w13_zeros=a["zeros"], w2_zeros=b["zeros"], group_size=INT4_GROUP)
                for a, b in zip(i13, i2)]) / layers
            row.update(int4_bytes=int4_bytes, int4_floor_us=int4_floor * 1e6, int4_graph_us=int4_experts_s * 1e6,
                       int4_pct_of_floor=100 * int4_floor / int4_experts_s,
                       int4_speedup_vs_bf16=fused_graph / int4_experts_s)
            line += (f"\n{'':14s} int4 experts {int4_experts_s * 1e6:7.1f} us (floor {int4_floor * 1e6:7.1f}, "
                     f"{row['int4_pct_of_floor']:5.1f}%; x{row['int4_speedup_vs_bf16']:.2f} bf16)")
        rows.append(row)
        print(line, flush=True)
    del w13, w2, q13, q2, i13, i2
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="JSON file to write")
    parser.add_argument("--layers", type=int, default=4, help="layers' weights cycled per timed call")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--shape", choices=sorted(SHAPES), action="append", help="default: all")
    parser.add_argument("--gpu", default="h200", help="rooflm/perf/gpus.py entry whose HBM and bf16 peak set the floor")
    parser.add_argument("--fp8", action="store_true", help="also time FP8 W8A8 experts (sm89+)")
    parser.add_argument("--int4", action="store_true", help="also time int4 weight-only experts (group 128)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("moe_kernel.py needs a CUDA GPU")
    device_name = torch.cuda.get_device_name()
    spec = get_gpu(args.gpu)
    bw, peak = spec.mem_bw, spec.peak_flops("bf16")
    print(f"{device_name}: floor from {spec.mem_bw_gbs:.0f} GB/s and {peak / 1e12:.0f} TFLOP/s bf16 ({spec.source})")
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for name in args.shape or sorted(SHAPES):
        rows += bench_shape(name, SHAPES[name], batches, args.layers, bw, peak, args.fp8, args.int4)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    report = dict(date=datetime.date.today().isoformat(), gpu=device_name, commit=commit, torch=torch.__version__,
                  hbm_gb_s=spec.mem_bw_gbs, peak_bf16_tflop_s=peak / 1e12, layers=args.layers, rows=rows)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
