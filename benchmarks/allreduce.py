"""All-reduce on this host's GPUs: NCCL against the one-shot symmetric-memory kernel, 8 KiB..64 MiB.

Tensor parallelism sends 2 all-reduces per layer of [tokens, hidden] in the model's dtype: at
batch 1 on the Llama-3-8B shape that is 8 KiB, where the time is the collective's fixed cost;
a 1024-token prefill chunk sends 8 MiB, where it is bandwidth. Both paths are the engine's own
(rooflm/distributed/allreduce.py, group.py), timed the ways the engine launches them: eagerly
(calls back to back) and inside a CUDA graph (PER_GRAPH calls captured, replayed; time per
call). Bus bandwidth is nccl-tests' busbw: bytes / time x 2 (N - 1) / N, comparable to the
link's bandwidth: hundreds of GB/s over NVLink, tens through PCIe or host memory (the 2026-11-23
H200x2 run's ~26 GB/s suggested the latter). Before timing, each symm size is checked against
NCCL's result and the fp32 reference sum.

Prints the GPU pair's peer access (symm needs it), one table, the size where symm stops
winning, and the batch-1 roofline bound for the 8B shape with the faster path's graph latency.

Usage: python benchmarks/allreduce.py [--ranks 2] [--out DIR] [--dtype bfloat16]   (one GPU per rank)
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

SIZES = [8 << 10 << i for i in range(14)]  # 8 KiB .. 64 MiB
MAX_BYTES = SIZES[-1]
PER_GRAPH = 20  # calls per captured graph
REPEATS = 15  # timed replays / eager loops per size (median)


def _median_ms(fn, repeats: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()  # warm-up
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


def _time_us(all_reduce, x: torch.Tensor, group) -> tuple[float, float]:
    """(eager, graph) microseconds per all-reduce of x, every rank in step."""
    def eager() -> None:
        for _ in range(PER_GRAPH):
            all_reduce(x)

    dist.barrier(group=group)
    eager_us = _median_ms(eager, REPEATS) * 1e3 / PER_GRAPH
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        all_reduce(x)  # NCCL's first call on a new stream sets it up: outside the capture
        torch.cuda.synchronize()
        dist.barrier(group=group)
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(PER_GRAPH):
                all_reduce(x)
    torch.cuda.current_stream().wait_stream(stream)
    dist.barrier(group=group)
    graph_us = _median_ms(graph.replay, REPEATS) * 1e3 / PER_GRAPH
    torch.cuda.synchronize()
    graph.reset()  # NCCL's teardown waits on graphs that captured it
    return eager_us, graph_us


def _check(symm, group, rank: int, size: int, nbytes: int, dtype: torch.dtype) -> float:
    """Max abs difference of symm's sum from NCCL's; raises if far from the fp32 reference."""
    from rooflm.distributed.allreduce import reference_all_reduce
    n = nbytes // dtype.itemsize
    parts = [torch.randn(n, generator=torch.Generator().manual_seed(1000 + r)).to(dtype) for r in range(size)]
    expected = reference_all_reduce(parts).cuda()
    a = parts[rank].cuda()
    b = a.clone()
    symm.all_reduce(a)
    dist.all_reduce(b, group=group)
    # A view at an offset takes the other branch (copy, then reduce): checked too.
    c = torch.empty(n + 8, dtype=dtype, device="cuda")[8:]
    c.copy_(parts[rank].cuda())
    symm.all_reduce(c)
    torch.cuda.synchronize()
    torch.testing.assert_close(a, expected, atol=0.05, rtol=0.02)
    torch.testing.assert_close(c, a, atol=0, rtol=0)
    return (a.float() - b.float()).abs().max().item()


def _rank(rank: int, size: int, port: int, dtype_name: str, queue) -> None:
    try:
        _measure(rank, size, port, dtype_name, queue)
    except BaseException:  # noqa: BLE001 - the parent waits on the queue: tell it, then leave
        import traceback
        queue.put({"error": f"rank {rank}:\n{traceback.format_exc()}"})
        time.sleep(1)  # the queue's feeder thread sends before the exit
        os._exit(1)


def _measure(rank: int, size: int, port: int, dtype_name: str, queue) -> None:
    from rooflm.distributed.allreduce import make_symm_all_reduce, peer_access
    from rooflm.distributed.group import destroy_group, init_group
    from rooflm.distributed.hang_dump import HangWatch

    watch = HangWatch(rank)
    dtype = getattr(torch, dtype_name)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    tp = init_group(rank, size, f"tcp://127.0.0.1:{port}", device, allreduce="nccl")
    p2p, why = peer_access(size)
    symm, symm_error = None, why
    try:
        symm = make_symm_all_reduce("symm", size, device, tp.device_group, tp.host_group, max_bytes=MAX_BYTES)
    except (ValueError, RuntimeError) as exc:
        symm_error = str(exc)

    def nccl(x):
        dist.all_reduce(x, group=tp.device_group)

    rows = []
    for nbytes in SIZES:
        x = torch.ones(nbytes // dtype.itemsize, dtype=dtype, device=device)
        row = {"bytes": nbytes}
        row["nccl_eager_us"], row["nccl_graph_us"] = _time_us(nccl, x, tp.host_group)
        if symm is not None:
            row["symm_max_diff_vs_nccl"] = _check(symm, tp.device_group, rank, size, nbytes, dtype)
            row["symm_eager_us"], row["symm_graph_us"] = _time_us(symm.all_reduce, x, tp.host_group)
        rows.append(row)
        watch.progress()
    if rank == 0:
        queue.put({"rows": rows, "p2p": p2p, "p2p_why": why, "symm_error": None if symm else symm_error,
                   "gpu": torch.cuda.get_device_name(device), "dtype": dtype_name, "ranks": size})
    watch.arm()
    ok = destroy_group(tp)
    os._exit(0 if ok else 3)  # a stuck NCCL teardown must not hang the benchmark


def _busbw(nbytes: int, us: float, ranks: int) -> float:
    return nbytes / (us * 1e-6) * 2 * (ranks - 1) / ranks / 1e9


def _fmt(v, spec=".1f") -> str:
    return "-" if v is None else format(v, spec)


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def report(result: dict) -> dict:
    """Print the table and the bound; returns what goes into allreduce.json."""
    ranks, rows = result["ranks"], result["rows"]
    print(f"all-reduce, {ranks} x {result['gpu']}, {result['dtype']}; peer access: "
          f"{'yes' if result['p2p'] else 'NO (' + result['p2p_why'] + ')'}; "
          f"symm: {'ran' if result['symm_error'] is None else 'unavailable: ' + result['symm_error']}")
    print("| size | NCCL eager us | NCCL graph us | symm eager us | symm graph us | NCCL busbw GB/s "
          "| symm busbw GB/s | faster in a graph |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    crossover = None
    for r in rows:
        symm_us = r.get("symm_graph_us")
        faster = "-" if symm_us is None else ("symm" if symm_us < r["nccl_graph_us"] else "NCCL")
        if faster == "NCCL" and crossover is None:
            crossover = r["bytes"]
        print(f"| {_size(r['bytes'])} | {r['nccl_eager_us']:.1f} | {r['nccl_graph_us']:.1f} | "
              f"{_fmt(r.get('symm_eager_us'))} | {_fmt(symm_us)} | "
              f"{_busbw(r['bytes'], r['nccl_graph_us'], ranks):.1f} | "
              f"{_fmt(None if symm_us is None else _busbw(r['bytes'], symm_us, ranks))} | {faster} |")
    if rows and "symm_max_diff_vs_nccl" in rows[0]:
        print(f"symm vs NCCL, max abs difference over all sizes: "
              f"{max(r['symm_max_diff_vs_nccl'] for r in rows):.3g} (each also within bf16 tolerance "
              f"of the fp32 reference sum)")
    if result["symm_error"] is None:
        print("symm is faster in a graph for every size" if crossover is None
              else f"symm is faster in a graph below {_size(crossover)} (the engine's cut: 4 MiB)")
    small = rows[0]
    latency_s = min(small["nccl_graph_us"], small.get("symm_graph_us") or float("inf")) * 1e-6
    out = {"ranks": ranks, "gpu": result["gpu"], "dtype": result["dtype"], "p2p": result["p2p"],
           "p2p_why": result["p2p_why"], "symm_error": result["symm_error"], "rows": rows,
           "symm_faster_below_bytes": crossover}
    try:
        from rooflm.model.presets import PRESETS
        from rooflm.perf.gpus import get_gpu
        from rooflm.perf.roofline import phase_step_cost, summarize
        gpu = get_gpu("h200" if "h200" in result["gpu"].lower() else "h100")
        cfg = PRESETS["llama-3-8b"]
        one = summarize(phase_step_cost(cfg, "decode", 1, 256), gpu).floor_s
        two = summarize(phase_step_cost(cfg, "decode", 1, 256, tp=ranks, allreduce_latency_s=latency_s),
                        gpu).floor_s
        print(f"llama-3-8b batch-1 decode floor on {gpu.key}: TP=1 {one * 1e3:.2f} ms, TP={ranks} "
              f"{two * 1e3:.2f} ms with {latency_s * 1e6:.1f} us per 8 KiB collective (the faster path, "
              f"in a graph) -> bound {one / two:.2f}x")
        out.update(bound_speedup=one / two, floor_tp1_ms=one * 1e3, floor_tpN_ms=two * 1e3,
                   latency_8k_us=latency_s * 1e6)
    except (ImportError, KeyError) as exc:
        print(f"(no roofline bound: {exc})")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    if torch.cuda.device_count() < args.ranks:
        raise SystemExit(f"needs {args.ranks} GPUs, found {torch.cuda.device_count()}")
    from rooflm.engine.executor import _free_port
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, args.dtype, queue), daemon=True)
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    try:
        result = queue.get(timeout=300)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                print(f"rank {procs.index(p)} did not exit in 30 s: killed")
                p.kill()
    if "error" in result:
        raise SystemExit(f"all-reduce benchmark failed on {result['error']}")
    out = report(result)
    exit_codes = [p.exitcode for p in procs]
    if any(exit_codes):
        print(f"rank exit codes {exit_codes} (3: leaving the group was abandoned after 15 s)")
    if args.out:
        with open(os.path.join(args.out, "allreduce.json"), "w") as f:
            json.dump({**out, "exit_codes": exit_codes}, f, indent=1)


if __name__ == "__main__":
    main()
