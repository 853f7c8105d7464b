"""Where a verify step's device idle time goes, batch 1 (n-gram target).

A verify step runs synchronously: after its results come back the host processes them, plans,
schedules, proposes and prepares the next step while the device waits. This script measures
that wait and names the host phase it falls in:
  1. the n-gram engine (budget policy) with the replay proposer, replayed to a fixed point
     (the output it replays is its own), so every step verifies k drafts at the set acceptance;
  2. one run with the engine's phase ranges (perf/profile.py's EngineInstrument): host seconds
     per step in each phase (exclusive);
  3. one run under torch.profiler: the union of the device's kernel intervals per step, and
     each idle gap between kernels split over the innermost engine phase ranges it overlaps.

    python benchmarks/spec_host_gap.py --out DIR
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from rooflm import LLM, SamplingParams  # noqa: E402
from rooflm.perf.profile import RANGE_PREFIX, EngineInstrument  # noqa: E402
from rooflm.spec.replay import ReplayProposer  # noqa: E402


def fixed_point(llm, prompts, params, acceptance, vocab, max_repeats=6):
    """Replay until the output is the one replayed; returns (runs, reached)."""
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for repeat in range(1, max_repeats + 1):
        continuation = {tuple(p): o for p, o in zip(prompts, outs)}
        llm.engine.spec.set_proposer(ReplayProposer(continuation, 1 - acceptance, vocab))
        new = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if new == outs:
            return repeat, True
        outs = new
    return max_repeats, False


def phase_times(llm, prompts, params):
    """Host seconds per step in each engine phase (exclusive), and wall seconds per step."""
    instrument = EngineInstrument(llm.engine, None, use_nvtx=False)
    instrument.install()
    steps0 = llm.engine.num_steps
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    instrument.uninstall()
    steps = llm.engine.num_steps - steps0
    per_step = {k: v / steps * 1e3 for k, v in sorted(instrument.record.phase_s.items(), key=lambda kv: -kv[1])}
    return steps, wall / steps * 1e3, per_step


def _union(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def idle_by_phase(llm, prompts, params):
    """Device busy and idle ms per step, and idle ms per step split by the host phase it fell in."""
    instrument = EngineInstrument(llm.engine, None, use_nvtx=False)
    instrument.install()
    steps0 = llm.engine.num_steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params)
        torch.cuda.synchronize()
    instrument.uninstall()
    steps = llm.engine.num_steps - steps0
    events = prof.events()
    kernels = [(e.time_range.start, e.time_range.end) for e in events
               if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
    ranges = [(e.time_range.start, e.time_range.end, e.name[len(RANGE_PREFIX):]) for e in events
              if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith(RANGE_PREFIX)
              and e.name != RANGE_PREFIX + "step"]
    busy = _union(kernels)
    # Idle gaps from the first kernel of the run's second step on (the first waits on the prompt).
    gaps = [(a[1], b[0]) for a, b in zip(busy, busy[1:]) if b[0] - a[1] > 2.0]
    by_phase = collections.Counter()
    for start, end in gaps:
        # Each microsecond of the gap goes to the innermost (shortest) phase range covering it.
        covering = [r for r in ranges if r[0] < end and r[1] > start]
        points = sorted({start, end, *[max(start, r[0]) for r in covering], *[min(end, r[1]) for r in covering]})
        for a, b in zip(points, points[1:]):
            mid = (a + b) / 2
            inner = [r for r in covering if r[0] <= mid <= r[1]]
            name = min(inner, key=lambda r: r[1] - r[0])[2] if inner else "(outside any phase)"
            by_phase[name] += b - a
    span = busy[-1][1] - busy[0][0] if busy else 0.0
    busy_us = sum(b - a for a, b in busy)
    return {"steps": steps, "span_ms_per_step": span / steps / 1e3, "busy_ms_per_step": busy_us / steps / 1e3,
            "idle_ms_per_step": (span - busy_us) / steps / 1e3,
            "idle_by_phase_ms_per_step": {k: v / steps / 1e3 for k, v in by_phase.most_common()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--acceptance", type=float, default=0.9, help="replay's per-token acceptance")
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--out", default="benchmarks/results/spec-host-gap")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    llm = LLM(model=args.model, load_format="dummy", max_model_len=512, max_num_seqs=1, cuda_graph_max_batch=1,
              speculative_method="ngram", num_speculative_tokens=args.k, speculative_policy="budget")
    vocab = llm.engine.model_config.vocab_size
    prompts = [[random.Random(0).randrange(vocab // 8, vocab) for _ in range(128)]]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    repeats, reached = fixed_point(llm, prompts, params, args.acceptance, vocab)
    before = llm.engine.snapshot().spec
    steps, wall_ms, phases = phase_times(llm, prompts, params)
    after = llm.engine.snapshot().spec
    drafts = after.num_drafts - before.num_drafts
    length = 1 + (after.num_accepted_tokens - before.num_accepted_tokens) / max(1, drafts)
    idle = idle_by_phase(llm, prompts, params)
    result = {"device": torch.cuda.get_device_name(), "repeats": repeats, "fixed_point": reached,
              "steps": steps, "mean_accepted_length": length, "wall_ms_per_step": wall_ms,
              "host_phase_ms_per_step": phases, "profiled": idle}
    with open(os.path.join(args.out, "spec_host_gap.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"{result['device']}: {steps} steps, mean accepted length {length:.2f} "
          f"(fixed point {'reached' if reached else 'not reached'} after {repeats}), {wall_ms:.2f} ms a step")
    print("host ms per step, by phase (exclusive): " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))
    print(f"profiled: device busy {idle['busy_ms_per_step']:.2f} ms, idle {idle['idle_ms_per_step']:.2f} ms a step; "
          "idle by host phase: " + ", ".join(f"{k} {v:.3f}" for k, v in idle["idle_by_phase_ms_per_step"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
