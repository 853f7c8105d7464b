"""Where the host's time goes in an offline run: cProfile around the engine loop.

Usage: python benchmarks/host_profile.py --model llama-3-8b --load-format dummy --num-prompts 500 \
           --input-len 230 --output-len 200 --range-ratio 0.9 --max-model-len 4096 [--out DIR]

Submits random requests like `rooflm bench throughput`, then steps the engine
under cProfile and prints the functions with the most time of their own
(tottime) and in total (cumtime). cProfile slows Python down (roughly 1.5-2x),
so the absolute times are inflated; the ranking is what this is for.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    from rooflm.bench.throughput import random_requests
    from rooflm.engine_args import add_engine_args, engine_kwargs
    from rooflm.engine.llm_engine import LLMEngine
    from rooflm.sampling_params import SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=500)
    parser.add_argument("--input-len", type=int, default=230)
    parser.add_argument("--output-len", type=int, default=200)
    parser.add_argument("--range-ratio", type=float, default=0.9)
    parser.add_argument("--prompt-seed", type=int, default=0)
    parser.add_argument("--top", type=int, default=45)
    parser.add_argument("--out", default=None, help="folder for the full stats (host_profile.txt)")
    parser.add_argument("--device-trace-steps", type=int, default=0,
                        help="instead of cProfile: after --skip-steps steps, trace this many under "
                             "torch.profiler and print the GPU's busy fraction and time by kernel")
    parser.add_argument("--skip-steps", type=int, default=300)
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="instead of the whole run: after --skip-steps steps, time this many by the "
                             "engine's phases (exclusive host time) and under cProfile")
    add_engine_args(parser)
    args = parser.parse_args()
    engine = LLMEngine.from_kwargs(**engine_kwargs(args))
    requests = random_requests(args, engine.info.model_config.vocab_size)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("warm", list(reversed(requests[0].prompt_token_ids)), warm)
    while engine.has_unfinished_requests():
        engine.step()
    for i, r in enumerate(requests):
        engine.add_request(f"r{i}", r.prompt_token_ids,
                           SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True))
    if args.device_trace_steps:
        device_trace(engine, args)
        return
    if args.profile_steps:
        window_profile(engine, args)
        return
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    profiler.disable()
    elapsed = time.perf_counter() - t0
    alloc_stats(engine)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    print(f"{steps} steps in {elapsed:.2f} s under cProfile ({1e3 * elapsed / steps:.2f} ms/step)", file=text)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)
    report = text.getvalue()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host_profile.txt"), "w") as f:
            f.write(report)
    print(report)


def window_profile(engine, args) -> None:
    """Host time by engine phase, then cProfile, over a window of steps in the middle of the run."""
    from rooflm.perf.profile import EngineInstrument

    kinds = []
    engine.add_observer(lambda r: kinds.append(r.kind))
    for _ in range(args.skip_steps):
        engine.step()
    kinds.clear()
    instrument = EngineInstrument(engine, None, use_nvtx=False)
    instrument.install()
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    for _ in range(args.profile_steps):
        engine.step()
    untraced = time.perf_counter() - t0
    phases = dict(instrument.record.phase_s)
    counts = {k: kinds.count(k) for k in sorted(set(kinds))}  # the timed window's steps, not cProfile's
    profiler.enable()
    for _ in range(args.profile_steps):
        engine.step()
    profiler.disable()
    print(f"{args.profile_steps} steps after {args.skip_steps}: {untraced * 1e3 / args.profile_steps:.2f} ms/step, "
          f"kinds {counts}")
    for name, s in sorted(phases.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<14}{1e3 * s / args.profile_steps:8.2f} ms/step")
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)
    print(text.getvalue())


def alloc_stats(engine) -> None:
    """cudaMalloc / cudaFree calls of the caching allocator during the run: a free can wait for
    the whole device, so a run that keeps allocating new sizes pays for it on the host."""
    import torch

    if not torch.cuda.is_available():
        return
    s = torch.cuda.memory_stats()
    print(f"allocator: {s.get('num_device_alloc', 0)} device allocs, {s.get('num_device_free', 0)} frees, "
          f"{s.get('num_alloc_retries', 0)} retries (cache flushed), "
          f"reserved {torch.cuda.memory_reserved() / 2**30:.2f} GiB")


def device_trace(engine, args) -> None:
    """GPU busy fraction and kernel time by class over a window of steps in the middle of the run."""
    import json

    import torch

    from rooflm.perf.profile import RANGE_PREFIX, analyse_device_trace

    kinds = []
    engine.add_observer(lambda r: kinds.append((r.kind, r.num_seqs, r.shape.num_tokens, r.graph)))
    for _ in range(args.skip_steps):
        engine.step()
    kinds.clear()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(args.device_trace_steps):
            with torch.profiler.record_function(RANGE_PREFIX + "step"):
                engine.step()
        torch.cuda.synchronize()
    alloc_stats(engine)
    path = os.path.join(args.out or ".", "device_trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        dev = analyse_device_trace(json.load(f))
    print(f"{len(kinds)} steps reported: " + ", ".join(
        f"{k}/{n} seqs/{t} tok/{g}" for k, n, t, g in kinds[:12]))
    print(f"window {dev['window_us'] / 1e3:.1f} ms, GPU busy {dev['busy_fraction']:.1%}")
    for cls, us in sorted(dev["by_class_us"].items(), key=lambda kv: -kv[1]):
        print(f"  {cls:<24}{us / 1e3:9.2f} ms")
    for name, us in dev["top_kernels_us"]:
        print(f"  {us / 1e3:9.2f} ms  {name[:90]}")
    os.remove(path)  # tens of MB


if __name__ == "__main__":
    main()
