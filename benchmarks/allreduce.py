"""NCCL all-reduce time on this host's GPUs, for the messages tensor parallelism sends.

A decode step of TP=N sends 2 all-reduces per layer of [batch, hidden] plus the embedding's
and the logits' gather; at batch 1 they are 8 kB and their time is NCCL's fixed cost, not
bandwidth. This measures it both ways the engine launches them: eagerly (one launch each) and
inside a CUDA graph (50 captured back to back, replayed; the time per all-reduce), and prints
what that fixed cost does to the roofline's batch-1 bound for the Llama-3-8B shape.

Usage: python benchmarks/allreduce.py [--ranks 2] [--out DIR]   (one GPU per rank)
"""

from __future__ import annotations

import argparse
import json
import os
import socket

import torch
import torch.distributed as dist

ROWS = (1, 8, 64, 256)
HIDDEN = 4096
REPEATS = 200
PER_GRAPH = 50


def _time_ms(fn, repeats: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def _rank(rank: int, size: int, port: int, queue) -> None:
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            device_id=torch.device("cuda", rank))
    results = []
    for rows in ROWS:
        x = torch.randn(rows, HIDDEN, dtype=torch.bfloat16, device="cuda")
        eager_ms = _time_ms(lambda: dist.all_reduce(x), REPEATS)
        stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        dist.barrier()
        with torch.cuda.stream(stream):
            dist.all_reduce(x)  # warm-up on the capture stream
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(PER_GRAPH):
                    dist.all_reduce(x)
        graph_ms = _time_ms(graph.replay, REPEATS // 4) / PER_GRAPH
        results.append({"rows": rows, "bytes": x.numel() * 2, "eager_us": eager_ms * 1e3,
                        "graph_us": graph_ms * 1e3})
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        queue.put(results)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if torch.cuda.device_count() < args.ranks:
        raise SystemExit(f"needs {args.ranks} GPUs, found {torch.cuda.device_count()}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, queue)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    results = queue.get(timeout=300)
    for p in procs:
        p.join()
    print(f"NCCL all-reduce, {args.ranks} ranks, bf16 [rows, {HIDDEN}] (median):")
    print(f"{'rows':>6} {'kB':>8} {'eager us':>10} {'graph us':>10}")
    for r in results:
        print(f"{r['rows']:>6} {r['bytes'] / 1e3:>8.1f} {r['eager_us']:>10.1f} {r['graph_us']:>10.1f}")
    from rooflm.model.presets import PRESETS
    from rooflm.perf.gpus import get_gpu
    from rooflm.perf.roofline import phase_step_cost, summarize

    gpu_name = torch.cuda.get_device_name(0).lower()
    gpu = get_gpu("h200" if "h200" in gpu_name else "h100")
    latency_s = results[0]["graph_us"] * 1e-6
    cfg = PRESETS["llama-3-8b"]
    one = summarize(phase_step_cost(cfg, "decode", 1, 256), gpu).floor_s
    two = summarize(phase_step_cost(cfg, "decode", 1, 256, tp=args.ranks, allreduce_latency_s=latency_s), gpu).floor_s
    print(f"llama-3-8b batch-1 decode floor on {gpu.key}: TP=1 {one * 1e3:.2f} ms, TP={args.ranks} "
          f"{two * 1e3:.2f} ms with {latency_s * 1e6:.1f} us per collective -> bound {one / two:.2f}x")
    if args.out:
        with open(os.path.join(args.out, "allreduce.json"), "w") as f:
            json.dump({"ranks": args.ranks, "results": results, "bound_speedup": one / two,
                       "floor_tp1_ms": one * 1e3, "floor_tpN_ms": two * 1e3}, f, indent=1)


if __name__ == "__main__":
    main()
