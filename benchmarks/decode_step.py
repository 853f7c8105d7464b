"""Where a steady decode step's time goes: host, graph launch, kernels, gaps between kernels.

For each batch size B: B requests of --input-len random tokens decode (greedy,
ignore_eos) until the measurement is over. Then, in the same process:

  step_sync   engine.step() per step, synchronous (schedule, prepare, replay, sample, read back)
  step_async  the same with async scheduling (step t+1 queued before step t is read)
  replay      the decode graph replayed back to back, nothing else: the device's floor
              for this graph, launch gaps between its kernels included
  kernels     from a profiler trace of replays: kernels per replay, the sum of their
              durations, and the idle time between them inside a replay

so step_sync - replay is host time the GPU waits for, and replay - kernels is the
cost of kernel boundaries inside the graph. One engine per variant.

    python benchmarks/decode_step.py --batch-sizes 1 64 --variants gemv+pdl gemv cublas --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rooflm.engine.llm_engine import LLMEngine  # noqa: E402
import rooflm.envs as envs  # noqa: E402
from rooflm.sampling_params import SamplingParams  # noqa: E402


def _events_ms(fn, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _wall_ms(fn, reps: int, windows: int = 5) -> float:
    """Median over `windows` windows of the mean wall time per call: a host hiccup (a GC
    pause, a noisy neighbour) moves one window, not the result."""
    per = []
    for _ in range(windows):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        per.append((time.perf_counter() - t0) * 1e3 / reps)
    return sorted(per)[len(per) // 2]


def _trace_kernels(fn, reps: int) -> list[tuple[float, float, str]]:
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    return sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in trace["traceEvents"]
                  if e.get("ph") == "X" and e.get("cat", "").lower() in ("kernel", "gpu_memcpy", "gpu_memset"))


def _largest_gaps(ks: list[tuple[float, float, str]], reps: int, top: int = 6) -> dict:
    """Idle time on the device between consecutive kernels/copies of a traced window."""
    gaps = [(ks[i + 1][0] - ks[i][1], ks[i][2][:40], ks[i + 1][2][:40]) for i in range(len(ks) - 1)]
    idle = sum(g for g, _, _ in gaps if g > 0)
    span = ks[-1][1] - ks[0][0] if ks else 0.0
    return {"idle_ms_per_step": idle / reps / 1e3, "span_ms_per_step": span / reps / 1e3,
            "largest_gaps_us": [(round(g, 1), a, b) for g, a, b in sorted(gaps, reverse=True)[:top]]}


def _replay_kernels(graph, reps: int) -> dict:
    """Kernels per replay, their summed duration and the gaps between them (profiler trace)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    ks = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in trace["traceEvents"]
                if e.get("ph") == "X" and e.get("cat", "").lower() == "kernel")
    if not ks:
        return {}
    busy = sum(e - s for s, e, _ in ks)
    gaps = [max(0.0, ks[i + 1][0] - ks[i][1]) for i in range(len(ks) - 1)]
    gaps.sort()
    per = len(ks) / reps
    by_name: dict[str, float] = {}
    for s, e, n in ks:
        by_name[n] = by_name.get(n, 0.0) + e - s
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:10]
    return {"kernels_per_replay": per, "kernel_ms": busy / reps / 1e3,
            "gap_ms": sum(gaps) / reps / 1e3, "median_gap_us": gaps[len(gaps) // 2],
            "p90_gap_us": gaps[int(len(gaps) * 0.9)],
            "top_kernels_ms": [(n[:70], t / reps / 1e3) for n, t in top]}


def _drain(engine: LLMEngine) -> None:
    """Process the step in flight (async scheduling), so the mode can switch."""
    engine.drain()


def measure(engine: LLMEngine, batch: int, input_len: int, steps: int) -> dict:
    vocab = engine.info.model_config.vocab_size
    rng = random.Random(batch)
    params = SamplingParams(temperature=0.0, max_tokens=16 * steps + 200, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", [rng.randrange(vocab) for _ in range(input_len)], params)
    while any(s.num_computed_tokens < input_len for r in engine.requests.values() for s in r.seqs):
        engine.step()
    for _ in range(5):
        engine.step()
    res = {"batch": batch, "input_len": input_len}
    _drain(engine)
    engine.async_scheduling = False
    res["step_sync_ms"] = _wall_ms(engine.step, steps)
    res["sync_trace"] = _largest_gaps(_trace_kernels(engine.step, 10), 10)
    engine.async_scheduling = True
    engine.step()
    res["step_async_ms"] = _wall_ms(engine.step, steps)
    res["async_trace"] = _largest_gaps(_trace_kernels(engine.step, 10), 10)
    _drain(engine)
    engine.async_scheduling = False
    graphs = engine.runner.graphs
    size = graphs.graph_size(batch)
    graph = graphs.graphs[size]
    res["graph_size"] = size
    res["replay_ms"] = _events_ms(graph.replay, steps)
    res.update(_replay_kernels(graph, 5))
    engine.abort_request(list(engine.requests))
    engine.async_scheduling = True  # the CUDA default
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20, help="steps per timing window (5 windows)")
    ap.add_argument("--variants", nargs="+", default=["gemv+pdl", "gemv", "cublas"],
                    choices=["gemv+pdl", "gemv", "cublas+pdl", "cublas"],
                    help="batch-1 layers as fused Triton GEMVs or cuBLAS; programmatic dependent "
                         "launch of the Triton decode kernels on or off")
    ap.add_argument("--split-below-programs-per-sm", type=float, nargs="+", default=[None],
                    help="decode attention splits the KV range when (sequences x KV heads) is under "
                         "this many programs per SM; one engine per value (default: the kernel's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    from rooflm.kernels import decode_attention
    default_split = decode_attention.SPLIT_BELOW_PROGRAMS_PER_SM
    runs = [(v, sp) for v in args.variants for sp in args.split_below_programs_per_sm]
    for variant, split_below in runs:
        envs.put("ROOFLM_PDL", "1" if variant.endswith("+pdl") else "0")  # read at graph capture
        decode_attention.SPLIT_BELOW_PROGRAMS_PER_SM = split_below or default_split
        engine = LLMEngine.from_kwargs(model=args.model, load_format="dummy", max_model_len=2048,
                                       decode_gemv=variant.startswith("gemv"))
        for b in args.batch_sizes:
            r = measure(engine, b, args.input_len, args.steps)
            r["variant"] = variant + (f"/split<{split_below:g}" if split_below else "")
            rows.append(r)
            print(json.dumps(r), flush=True)
        del engine
        torch.cuda.empty_cache()
    print(f"\n{'variant':18s} {'B':>3s} {'sync':>7s} {'async':>7s} {'replay':>7s} {'kernels':>7s} "
          f"{'gaps':>6s} {'#k':>5s} {'gap med/p90 us':>15s}")
    for r in rows:
        print(f"{r['variant']:18s} {r['batch']:3d} {r['step_sync_ms']:7.3f} {r['step_async_ms']:7.3f} "
              f"{r['replay_ms']:7.3f} {r.get('kernel_ms', 0):7.3f} {r.get('gap_ms', 0):6.3f} "
              f"{r.get('kernels_per_replay', 0):5.0f} {r.get('median_gap_us', 0):7.2f}/{r.get('p90_gap_us', 0):.2f}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "decode-step.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "commit": os.environ.get("ROOFLM_COMMIT", "unknown"),
                       "date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
