"""`rooflm profile`: run a real engine on a synthetic batch and say what limits its steps.

The run:
  1. build an LLMEngine from the engine flags; submit B requests of P random
     token ids each (ignore_eos, max_tokens N);
  2. warm-up steps (the prefill, Triton compilation, allocator growth): by default
     until every prompt is in and 3 decode-only steps ran, or --warmup-steps;
  3. S timed steps without the profiler: wall time per step, CPU time per phase,
     and each step's bytes and FLOPs from the roofline model (perf/live.py);
  4. S more steps under torch.profiler (CPU activity, and CUDA activity on a
     GPU), exported as a Chrome trace that chrome://tracing and Perfetto open.

Each step is the engine's own `engine.step()`. The phases inside it get
profiler ranges (record_function, and NVTX on CUDA) through the engine's
PhaseTracer hook (engine.set_tracer): schedule, launch (block ops, input
building, the copy to the device, the CUDA graph replay or the eager forward,
the LM head, the sampler), collect and process. Each step's bytes and FLOPs come
from its StepReport (engine.add_observer) through the same StepMeter the server
uses for its MBU/MFU gauges. Nothing is patched, so the profiled step is the real one.

The verdict, first match wins, always with the fraction of each roof beside it:
  * KV-capacity-bound: preemptions during the run, or steps where requests
    waited while the KV pool was over 95% used;
  * memory-bound or compute-bound: the step's bytes and FLOPs (step_cost) over
    its time reach at least half of the device's peak bandwidth or FLOP rate;
    the larger fraction names the bound. Peaks: the GPU table, or this machine
    measured (perf/gpus.py: no table lists CPUs);
  * far from both roofs, the largest share of the step names the limit
    (time_shares): CPU/launch-bound when it is overhead (on a GPU the idle gaps
    between kernels, with the time the host spent in device syncs; on a CPU the
    time outside any op and the small ops), kernel-bound when it is the matmul
    and attention kernels' own time over the step's floor. Every share is
    printed as evidence.
An MoE model's routing is counted too (the engine's count_expert_load, on by default here):
tokens routed to each expert per MoE layer over the profiled steps, as the busiest expert's
load over the mean (per step, then over the whole pass), the hottest expert, and under expert
parallelism the busiest rank's load over the mean (the rank every other waits for).
Notes flag a measurement to distrust: timed and profiled steps far apart, or a
CPU shared with other processes (load average above the core count).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional, TextIO

import torch

from rooflm.engine.report import PhaseTracer
from rooflm.engine_args import engine_kwargs
from rooflm.perf.gpus import GpuSpec, get_gpu, measure_gpu
from rooflm.perf.gpus import measure_host
from rooflm.perf.live import StepMeter, default_gpu_for

RANGE_PREFIX = "rooflm."

# Phases in the order a step runs them; the label is what the summary prints.
PHASES = (
    ("schedule", "schedule"),
    ("block_ops", "block ops (swap / copy-on-write)"),
    ("prepare", "prepare inputs"),
    ("to_device", "copy inputs to device"),
    ("graph", "forward (CUDA graph replay)"),
    ("forward", "forward"),
    ("lm_head", "lm head (logits)"),
    ("sample", "sample"),
    ("launch", "launch, rest (sampling metadata, queueing)"),
    ("collect", "collect (wait for the device, read results)"),
    ("process", "detokenize + output"),
    ("step", "engine.step, rest"),
)

AUTO_WARMUP_DECODE_STEPS = 3  # decode-only steps that end an automatic warm-up
KV_FULL_USAGE = 0.95
# A step at this fraction of a roof or above is bound by it; under it for both roofs, the
# verdict names what takes the time instead (time_shares).
NEAR_ROOF = 0.50

# Kernel classes by name pattern (lower case), first match wins: sampling goes
# before the broad element-wise patterns so that exponential_ / argmax kernels,
# which are also "elementwise" or "reduce" kernels, land in sampling.
KERNEL_CLASSES = (
    ("memcpy", ("memcpy", "memset")),
    # Attention before GEMM: FlashAttention-4's kernels are CuTe DSL ones, named cutlass_..._flash_...
    ("attention", ("attention", "_decode_attention", "_prefill", "flash", "fmha")),
    ("GEMM", ("gemm", "gemv", "matmul", "cutlass", "sm90_xmma", "nvjet", "splitkreduce")),
    ("sampling", ("sample", "sort", "topk", "exponential", "argmax", "softmax")),
    ("norm/elementwise", ("rms", "norm", "silu", "elementwise", "vectorized", "add", "mul",
                          "rope", "kv_write", "reduce")),
)

# The same classes for CPU ops (aten names without the "aten::" prefix).
CPU_OP_CLASSES = (
    ("memcpy", {"copy_", "_to_copy", "to", "contiguous", "clone", "fill_", "zero_", "zeros",
                "empty", "empty_like", "index_put_", "_index_put_impl_", "index_copy_"}),
    ("GEMM", {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "mv", "dot",
              "_weight_int4pack_mm_for_cpu", "_weight_int8pack_mm"}),
    ("attention", {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
                   "_scaled_dot_product_attention_math", "_scaled_dot_product_efficient_attention",
                   "_scaled_dot_product_flash_attention"}),
    ("sampling", {"sort", "topk", "exponential_", "argmax", "softmax", "_softmax", "log_softmax",
                  "_log_softmax", "multinomial", "cumsum", "gather", "scatter_", "scatter_add_"}),
)
# Heavy compute ops: the work a step must do; everything else is overhead at small sizes.
HEAVY_CPU_OPS = CPU_OP_CLASSES[1][1] | CPU_OP_CLASSES[2][1]


def classify_kernel(name: str) -> str:
    lowered = name.lower()
    for cls, patterns in KERNEL_CLASSES:
        if any(p in lowered for p in patterns):
            return cls
    return "other"


def classify_cpu_op(name: str) -> str:
    short = name.split("::", 1)[1] if "::" in name else name
    for cls, names in CPU_OP_CLASSES:
        if short in names:
            return cls
    return "norm/elementwise" if any(p in short for p in ("norm", "rsqrt", "silu", "mul", "add",
                                                           "pow", "mean", "neg", "cat", "sub",
                                                           "div", "exp", "cos", "sin")) else "other ops"


# ---- instrumentation of one engine instance --------------------------------------------------


@dataclass
class PassRecord:
    """What one pass (warm-up, timed, profiled) saw."""

    step_wall_s: list[float] = field(default_factory=list)
    phase_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    stats: list = field(default_factory=list)  # StepStats per executed step
    preemptions: int = 0
    waiting_on_full_pool: int = 0  # steps whose schedule left requests waiting, pool > 95% used
    peak_usage: float = 0.0


class EngineInstrument(PhaseTracer):
    """The engine's phase tracer and a step observer: named ranges around the phases of each
    step (engine.set_tracer), and each reported step's bytes and FLOPs (engine.add_observer).
    It reads the engine through its face only; nothing is patched."""

    def __init__(self, engine, meter: Optional[StepMeter], use_nvtx: bool):
        self.engine = engine
        self.meter = meter
        self.use_nvtx = use_nvtx
        self.record = PassRecord()
        self._stack: list[list] = []  # [phase, seconds spent in child phases]
        self._kv_stalls = engine.snapshot().kv_admission_stalls

    # Ranges: record_function for the profiler, NVTX for Nsight, perf_counter for the summary.
    @contextlib.contextmanager
    def phase(self, name: str):
        label = RANGE_PREFIX + name
        if self.use_nvtx:
            torch.cuda.nvtx.range_push(label)
        frame = [name, 0.0]
        self._stack.append(frame)
        t0 = time.perf_counter()
        try:
            with torch.profiler.record_function(label):
                yield
        finally:
            elapsed = time.perf_counter() - t0
            self._stack.pop()
            self.record.phase_s[name] += elapsed - frame[1]  # exclusive time
            if self._stack:
                self._stack[-1][1] += elapsed
            if self.use_nvtx:
                torch.cuda.nvtx.range_pop()

    def observe(self, report) -> None:
        """Each step whose results came back (with async scheduling, the previous step's)."""
        if self.meter is not None:
            self.record.stats.append(self.meter.observe(report))

    def install(self) -> None:
        self.engine.set_tracer(self)
        self.engine.add_observer(self.observe)

    def uninstall(self) -> None:
        self.engine.set_tracer(None)
        self.engine.remove_observer(self.observe)

    def _note_kv(self) -> None:
        snap = self.engine.snapshot()
        self.record.peak_usage = max(self.record.peak_usage, snap.kv_usage)
        # Admission keeps room for the running requests' growth, so requests can wait for KV
        # room with the pool well under full: the scheduler's stall count says so.
        stalled = snap.kv_admission_stalls > self._kv_stalls
        self._kv_stalls = snap.kv_admission_stalls
        if snap.num_waiting_reqs and (snap.kv_usage > KV_FULL_USAGE or stalled):
            self.record.waiting_on_full_pool += 1

    def step(self) -> bool:
        """One engine step inside the outer range; False when nothing was scheduled."""
        before = self.engine.snapshot()
        t0 = time.perf_counter()
        with self.phase("step"):
            self.engine.step()
        wall = time.perf_counter() - t0
        after = self.engine.snapshot()
        self.record.preemptions += after.num_preemptions - before.num_preemptions
        self._note_kv()
        if after.steps == before.steps and not self.engine.has_unfinished_requests():
            return False  # nothing was scheduled and nothing is left
        self.record.step_wall_s.append(wall)
        return True

    def run_pass(self, steps: int) -> PassRecord:
        self.record = PassRecord()
        sync = torch.cuda.synchronize if self.use_nvtx else (lambda: None)
        sync()
        for _ in range(steps):
            if not self.engine.has_unfinished_requests() or not self.step():
                break
        sync()
        return self.record

    def run_warmup(self, decode_steps: int, max_steps: int) -> PassRecord:
        """Steps until `decode_steps` steps in a row have no prefill token (every prompt is in),
        or `max_steps`: the profile then sees the steady decode state, kernels compiled."""
        self.record = PassRecord()
        in_a_row = 0
        while in_a_row < decode_steps and len(self.record.step_wall_s) < max_steps:
            if not self.engine.has_unfinished_requests() or not self.step():
                break
            last = self.record.stats[-1] if self.record.stats else None
            in_a_row = in_a_row + 1 if last is not None and last.num_tokens == last.num_sampled else 0
        return self.record


# ---- trace analysis --------------------------------------------------------------------------


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total = 0.0
    end = None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def analyse_device_trace(trace: dict) -> Optional[dict]:
    """GPU busy fraction and time by kernel class from a Chrome trace (times in us).

    The window is the device time of the work the profiled steps launched: the GPU-side
    mirror of their launch ranges ("rooflm.launch" as gpu_user_annotation: from the first
    kernel they launched to the end of the last). With async scheduling a step's kernels run
    after its host range has ended (the host launches step N+1 before it collects step N), so
    the host ranges would cut the last step's kernels off and count the previous, untraced
    step's as idle (an H100 FP8 decode step: 15.9 ms by host ranges, 21.2 ms on the device).
    Without the mirror: from the start of the first profiled step to the end of the last
    ("rooflm.step" host ranges). The busy time is the union of kernel, memcpy and memset
    intervals inside the window. None when the trace has no device events.
    """
    events = trace.get("traceEvents", [])
    steps = [e for e in events if e.get("ph") == "X" and e.get("name") == RANGE_PREFIX + "step"
             and e.get("cat") != "gpu_user_annotation"]
    launched = [e for e in events if e.get("ph") == "X" and e.get("name") == RANGE_PREFIX + "launch"
                and e.get("cat") == "gpu_user_annotation"]
    device = [e for e in events if e.get("ph") == "X"
              and e.get("cat", "").lower() in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not device or not steps:
        return None
    h0 = min(float(e["ts"]) for e in steps)
    h1 = max(float(e["ts"]) + float(e.get("dur", 0)) for e in steps)
    w0, w1 = h0, h1
    if launched:
        w0 = min(float(e["ts"]) for e in launched)
        w1 = max(float(e["ts"]) + float(e.get("dur", 0)) for e in launched)
    window = max(w1 - w0, 1e-9)
    intervals = []
    by_class: dict[str, float] = defaultdict(float)
    by_kernel: dict[str, float] = defaultdict(float)
    for e in device:
        s = max(float(e["ts"]), w0)
        t = min(float(e["ts"]) + float(e.get("dur", 0)), w1)
        if t <= s:
            continue
        intervals.append((s, t))
        cat = e.get("cat", "").lower()
        cls = "memcpy" if cat in ("gpu_memcpy", "gpu_memset") else classify_kernel(e.get("name", ""))
        by_class[cls] += t - s
        by_kernel[e.get("name", "?")] += t - s
    busy = _union_length(intervals)
    by_class["idle gaps"] = window - busy
    # The host blocked on the device (cudaStreamSynchronize, .item(), a blocking copy): time
    # the host cannot prepare the next launch in.
    sync_us = sum(min(float(e["ts"]) + float(e.get("dur", 0)), h1) - max(float(e["ts"]), h0)
                  for e in events if e.get("ph") == "X" and "synchronize" in e.get("name", "").lower()
                  and e.get("cat", "").lower() == "cuda_runtime"
                  and float(e["ts"]) < h1 and float(e["ts"]) + float(e.get("dur", 0)) > h0)
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:16]
    return {"window_us": window, "busy_us": busy, "busy_fraction": busy / window,
            "by_class_us": dict(by_class), "top_kernels_us": top, "sync_us": sync_us}


def analyse_cpu_ops(prof) -> dict:
    """Self CPU time of the profiled ops by class, and of the heavy compute ops (us)."""
    by_class: dict[str, float] = defaultdict(float)
    heavy = 0.0
    ops_total = 0.0
    calls = 0
    top = []
    for avg in prof.key_averages():
        name = avg.key
        if name.startswith(RANGE_PREFIX) or "::" not in name or name.startswith("ProfilerStep"):
            continue
        self_us = float(avg.self_cpu_time_total)
        ops_total += self_us
        by_class[classify_cpu_op(name)] += self_us
        short = name.split("::", 1)[1]
        if short in HEAVY_CPU_OPS:
            heavy += self_us
        calls += int(avg.count)
        top.append((name, self_us, int(avg.count)))
    top.sort(key=lambda t: -t[1])
    top_other = [t for t in top if t[0].split("::", 1)[1] not in HEAVY_CPU_OPS]
    return {"ops_self_us": ops_total, "heavy_self_us": heavy, "op_calls": calls,
            "by_class_us": dict(by_class), "top_ops": top[:8], "top_other_ops": top_other[:4]}


# ---- the run ---------------------------------------------------------------------------------


def _resolve_gpu(choice: str, device: torch.device) -> Optional[GpuSpec]:
    if device.type != "cuda":
        # No table lists CPUs: this one measured, as `bench` and `roofline --gpu measure` do.
        return measure_host(device)
    if choice != "auto":
        return get_gpu(choice)
    spec = default_gpu_for(device)
    return spec if spec is not None else measure_gpu(str(device))


def _per_step_ms(total_s: float, steps: int) -> float:
    return total_s / steps * 1e3 if steps else 0.0


def profile_engine(engine, *, batch_size: int, input_len: int, output_len: Optional[int],
                   steps: int, warmup_steps: Optional[int], output_dir: str, seed: int = 0,
                   temperature: float = 1.0, gpu: str = "auto") -> dict:
    """Run the warm-up, timed and profiled passes on `engine`; write the trace and summary.json.

    warmup_steps None: warm up until every prompt is in and a few decode-only steps
    have run, so the timed and profiled steps are the steady decode state; a number
    (0 included) profiles whatever those steps hold, prefill chunks too.
    output_len None: long enough that no request finishes during the passes.
    Returns the summary as a dict (the same as summary.json).
    """
    from rooflm.sampling_params import SamplingParams

    if batch_size < 1 or input_len < 1 or steps < 1 or (warmup_steps or 0) < 0:
        raise ValueError("batch size, input length and steps must be >= 1, warm-up steps >= 0")
    info = engine.info
    device = torch.device(info.device)
    on_cuda = device.type == "cuda"
    gpu_spec = _resolve_gpu(gpu, device)
    # Steps the prompts take at the scheduler's token budget; the first requests in
    # decode (one token a step) while the later ones are still prefilling.
    prefill_steps = -(-batch_size * input_len // info.max_num_batched_tokens)
    if output_len is None:
        # No request finishes during the passes: the prefill and warm-up steps, then the
        # timed and the profiled ones, within the context length.
        warmup = AUTO_WARMUP_DECODE_STEPS if warmup_steps is None else warmup_steps
        output_len = min(prefill_steps + warmup + 2 * steps + 2,
                         max(info.max_model_len - input_len, 1))
    vocab = info.model_config.vocab_size
    rng = random.Random(seed)
    params = SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True)
    for i in range(batch_size):
        prompt = [rng.randrange(vocab) for _ in range(input_len)]
        engine.add_request(f"profile-{i}", prompt, params)

    meter = StepMeter.for_engine(info, gpu=gpu_spec)
    instrument = EngineInstrument(engine, meter, use_nvtx=on_cuda)
    instrument.install()
    os.makedirs(output_dir, exist_ok=True)
    trace_path = os.path.join(output_dir, "trace.json")
    try:
        if warmup_steps is None:
            warm = instrument.run_warmup(AUTO_WARMUP_DECODE_STEPS,
                                         max_steps=2 * prefill_steps + AUTO_WARMUP_DECODE_STEPS + 64)
        else:
            warm = instrument.run_pass(warmup_steps)
        timed = instrument.run_pass(steps)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if on_cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        load_before = engine.expert_load(0)
        with torch.profiler.profile(activities=activities) as prof:
            profiled = instrument.run_pass(steps)
        load = None if load_before is None else engine.expert_load(
            engine.expert_load(0).steps_begun - load_before.steps_begun)
        prof.export_chrome_trace(trace_path)
    finally:
        instrument.uninstall()
    if not profiled.step_wall_s or not timed.step_wall_s:
        raise ValueError(f"the requests finished before the profiled steps ran: raise --output-len "
                         f"(now {output_len}) or lower --steps / --warmup-steps")

    with open(trace_path) as f:
        trace = json.load(f)
    summary = _summarise(engine, instrument, meter, gpu_spec, warm, timed, profiled, prof, trace)
    summary["expert_load"] = None if load is None else expert_load_summary(load)
    summary.update(
        model=info.model if info.model != "default" else "default (SmolLM2-135M-Instruct)",
        device=str(device), dtype=info.dtype,
        batch_size=batch_size, input_len=input_len, output_len=output_len,
        warmup_steps=len(warm.step_wall_s), steps=steps, temperature=temperature,
        trace=trace_path, summary_json=os.path.join(output_dir, "summary.json"))
    with open(summary["summary_json"], "w") as f:
        json.dump(summary, f, indent=2, default=str)
    return summary


def _summarise(engine, instrument: EngineInstrument, meter: StepMeter, gpu: Optional[GpuSpec],
               warm: PassRecord, timed: PassRecord, profiled: PassRecord, prof, trace: dict) -> dict:
    info = engine.info
    on_cuda = info.device_type == "cuda"
    n_timed = len(timed.step_wall_s)
    n_prof = len(profiled.step_wall_s)
    timed_wall = sum(timed.step_wall_s)
    prof_wall = sum(profiled.step_wall_s)
    s = {
        "cpu_run": not on_cuda,
        "timed_steps": n_timed,
        "profiled_steps": n_prof,
        "step_ms": _per_step_ms(timed_wall, n_timed),
        "step_ms_median": statistics.median(timed.step_wall_s) * 1e3,
        "step_ms_profiled": _per_step_ms(prof_wall, n_prof),
        "phase_ms_per_step": {name: _per_step_ms(timed.phase_s.get(name, 0.0), n_timed)
                              for name, _ in PHASES if name in timed.phase_s},
    }
    # Roofline figures over the timed steps (whole step wall time, as a user sees it).
    step_bytes = sum(st.bytes for st in timed.stats)
    step_flops = sum(st.flops for st in timed.stats)
    s["tokens_per_step"] = sum(st.num_tokens for st in timed.stats) / max(n_timed, 1)
    s["sampled_per_step"] = sum(st.num_sampled for st in timed.stats) / max(n_timed, 1)
    s["bytes_per_step"] = step_bytes / max(n_timed, 1)
    s["flops_per_step"] = step_flops / max(n_timed, 1)
    s["achieved_gbps"] = step_bytes / timed_wall / 1e9
    s["achieved_gflops"] = step_flops / timed_wall / 1e9
    s["tokens_per_s"] = sum(st.num_tokens for st in timed.stats) / timed_wall
    s["sampled_per_s"] = sum(st.num_sampled for st in timed.stats) / timed_wall

    s["kv"] = {
        "num_blocks": info.num_blocks, "block_size": info.block_size,
        "peak_usage": max(warm.peak_usage, timed.peak_usage, profiled.peak_usage),
        "preemptions_run": warm.preemptions + timed.preemptions + profiled.preemptions,
        "preemptions_measured": timed.preemptions + profiled.preemptions,
        "steps_waiting_on_full_pool": (warm.waiting_on_full_pool + timed.waiting_on_full_pool
                                       + profiled.waiting_on_full_pool),
        "waiting_at_end": engine.snapshot().num_waiting_reqs,
    }

    cpu_ops = analyse_cpu_ops(prof)
    s["cpu_ops"] = cpu_ops
    if gpu is not None and timed.stats:
        s["mbu"] = step_bytes / timed_wall / gpu.mem_bw
        s["mfu"] = step_flops / timed_wall / gpu.peak_flops(meter.compute_dtype)
        s["peak_gbps"] = gpu.mem_bw_gbs
        s["peak_tflops"] = gpu.peak_flops(meter.compute_dtype) / 1e12
        s["peaks_source"] = gpu.source
    if on_cuda:
        s["gpu"] = gpu.name if gpu else None
        dev = analyse_device_trace(trace)
        s["device_trace"] = dev
        s["gpu_busy_fraction"] = dev["busy_fraction"] if dev else None
    else:
        s["gpu"] = None
        s["gpu_busy_fraction"] = None
        s["cpu_peaks"] = {"name": gpu.name, "threads": torch.get_num_threads()}
        s["cpu_compute_fraction"] = min(cpu_ops["heavy_self_us"] / 1e6 / prof_wall, 1.0)
        s["load_average"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        s["cpu_count"] = os.cpu_count()
        s["cpu_outside_ops_fraction"] = max(prof_wall - cpu_ops["ops_self_us"] / 1e6, 0.0) / prof_wall
    s["notes"] = _notes(s)
    s["verdict"], s["evidence"] = _verdict(s, meter.compute_dtype)
    return s


def _imbalance(loads: list[int]) -> float:
    """max / mean of the loads (1.0: even); 1.0 for no tokens at all."""
    total = sum(loads)
    return max(loads) * len(loads) / total if total else 1.0


def _rank_loads(loads: list[int], ranks: int) -> list[int]:
    per = len(loads) // ranks
    return [sum(loads[r * per:(r + 1) * per]) for r in range(ranks)]


def expert_load_summary(load) -> dict:
    """Routing over the profiled steps (an engine ExpertLoad), per MoE layer and overall.

    Per layer: routed (token, expert) pairs; step_imbalance, the busiest expert's load over the
    mean in each step that routed tokens, averaged over those steps (at decode the experts
    touched are few and the busiest one is what a grouped GEMM waits for); pass_imbalance, the
    same over the pass's totals; the hottest expert and its share. Under expert parallelism the
    same per rank (rank_step_imbalance, rank_pass_imbalance, rank_share)."""
    layers = []
    for li, name in enumerate(load.layers):
        steps = [step[li] for step in load.counts if sum(step[li])]
        totals = [sum(col) for col in zip(*steps)] if steps else [0] * load.num_experts
        routed = sum(totals)
        hottest = max(range(load.num_experts), key=lambda e: totals[e])
        row = {"layer": name, "routed": routed, "steps": len(steps),
               "step_imbalance": statistics.fmean(_imbalance(s) for s in steps) if steps else 1.0,
               "pass_imbalance": _imbalance(totals), "hottest_expert": hottest,
               "hottest_share": totals[hottest] / routed if routed else 0.0,
               "experts_touched_per_step": (statistics.fmean(sum(1 for c in s if c) for s in steps)
                                            if steps else 0.0)}
        if load.ep_ranks > 1:
            ranks = _rank_loads(totals, load.ep_ranks)
            row["rank_step_imbalance"] = (statistics.fmean(_imbalance(_rank_loads(s, load.ep_ranks))
                                                           for s in steps) if steps else 1.0)
            row["rank_pass_imbalance"] = _imbalance(ranks)
            row["rank_share"] = [r / routed if routed else 0.0 for r in ranks]
        layers.append(row)
    counted = [row for row in layers if row["routed"]]
    out = {"num_layers": len(layers), "num_experts": load.num_experts, "top_k": load.top_k,
           "ep_ranks": load.ep_ranks, "steps": len(load.counts), "layers": layers,
           "routed": sum(row["routed"] for row in layers)}
    for key in ("step_imbalance", "pass_imbalance", "experts_touched_per_step") + (
            ("rank_step_imbalance", "rank_pass_imbalance") if load.ep_ranks > 1 else ()):
        out[key] = statistics.fmean(row[key] for row in counted) if counted else 1.0
    if counted:
        worst = max(counted, key=lambda row: row["step_imbalance"])
        hot = max(counted, key=lambda row: row["hottest_share"])
        out["worst_layer"] = {"layer": worst["layer"], "step_imbalance": worst["step_imbalance"]}
        out["hottest"] = {"layer": hot["layer"], "expert": hot["hottest_expert"], "share": hot["hottest_share"]}
    return out


def format_expert_load(e: dict) -> list[str]:
    lines = [f"MoE expert load ({e['num_layers']} MoE layers, {e['num_experts']} experts, top-{e['top_k']}; "
             f"{e['routed']:,} routed token-expert pairs over {e['steps']} profiled steps):"]
    if not e["routed"]:
        return lines + ["  no tokens routed in the profiled steps"]
    worst, hot = e["worst_layer"], e["hottest"]
    lines.append(f"  busiest expert per step: {e['step_imbalance']:.2f}x the mean (max/mean, averaged over "
                 f"layers and steps; worst layer {worst['layer']}: {worst['step_imbalance']:.2f}x); "
                 f"{e['experts_touched_per_step']:.1f} of {e['num_experts']} experts touched per step")
    lines.append(f"  over the pass: {e['pass_imbalance']:.2f}x the mean; hottest expert {hot['expert']} of "
                 f"{hot['layer']}, {hot['share']:.1%} of that layer's pairs "
                 f"(even: {1 / e['num_experts']:.1%})")
    if e["ep_ranks"] > 1:
        lines.append(f"  expert parallel over {e['ep_ranks']} ranks: the busiest rank gets "
                     f"{e['rank_step_imbalance']:.2f}x the mean per step, {e['rank_pass_imbalance']:.2f}x "
                     f"over the pass (every rank waits for it)")
    return lines


def _notes(s: dict) -> list[str]:
    """Warnings about the measurement itself."""
    notes = []
    timed, profiled = s["step_ms"], s["step_ms_profiled"]
    if timed > 0 and profiled > 0 and max(timed, profiled) > 2 * min(timed, profiled):
        notes.append(f"the timed and profiled steps differ {max(timed, profiled) / min(timed, profiled):.1f}x "
                     f"({timed:.2f} vs {profiled:.2f} ms): the machine's load changed between them, "
                     f"or the profiler's per-op cost dominates small ops")
    load, cpus = s.get("load_average"), s.get("cpu_count")
    # This run's own threads count in the load; more than the cores plus a margin means others.
    if load is not None and cpus and load > cpus + 0.5:
        threads = s.get("cpu_peaks", {}).get("threads", 1)
        notes.append(f"load average {load:.1f} on {cpus} CPUs: other processes share the cores, so "
                     f"times are inflated" + (
                         f"; with {threads} intra-op threads every parallel op waits for a thread "
                         f"the OS has parked: rerun on an idle machine or with --threads 1"
                         if threads > 1 else ""))
    return notes


def time_shares(s: dict) -> list[tuple[str, float, str]]:
    """Where the step's time goes, as (what, share of the step, evidence), largest first.

    The share of the work at the roof (the step's floor: its bytes at peak bandwidth or its
    FLOPs at the peak rate, the larger) is one entry; the rest is what keeps the step from it:
    on a GPU the idle gaps between kernels (the host launching, Python, synchronisation), the
    small kernels, and the heavy kernels' time over the floor; on a CPU the time outside any
    op (Python, framework), the small ops, and the heavy ops' time over the floor.
    """
    floor = max(s.get("mbu") or 0.0, s.get("mfu") or 0.0)  # the floor as a share of the step
    steps = max(s["profiled_steps"], 1)
    shares = []
    if not s["cpu_run"]:
        dev = s.get("device_trace")
        if not dev:
            return []
        window = dev["window_us"]
        by = dev["by_class_us"]
        heavy = (by.get("GEMM", 0.0) + by.get("attention", 0.0)) / window
        small = sum(us for cls, us in by.items()
                    if cls not in ("GEMM", "attention", "idle gaps")) / window
        idle = by.get("idle gaps", 0.0) / window
        sync_ms = dev.get("sync_us", 0.0) / 1e3 / steps
        shares.append(("launch gaps (the GPU idle between kernels: host time, Python, launches"
                       + (", synchronisation" if sync_ms else "") + ")", idle,
                       f"{by.get('idle gaps', 0.0) / 1e3 / steps:.3f} ms per step idle"
                       + (f", of which the host waited {sync_ms:.3f} ms in device syncs"
                          if sync_ms else "")))
        shares.append(("small kernels (norms, element-wise, sampling, copies)", small,
                       "; ".join(f"{cls} {us / 1e3 / steps:.3f} ms" for cls, us in by.items()
                                 if cls not in ("GEMM", "attention", "idle gaps"))))
    else:
        ops = s["cpu_ops"]
        wall_us = s["step_ms_profiled"] * 1e3 * steps or 1e-12
        heavy = ops["heavy_self_us"] / wall_us
        small = max(ops["ops_self_us"] - ops["heavy_self_us"], 0.0) / wall_us
        top_other = ", ".join(f"{name} {us / 1e3 / steps:.2f} ms"
                              for name, us, _ in ops["top_other_ops"][:3])
        shares.append(("host time outside any op (Python, the framework's dispatch)",
                       s["cpu_outside_ops_fraction"],
                       f"{ops['op_calls'] / steps:,.0f} op calls per step, "
                       f"{ops['ops_self_us'] / max(ops['op_calls'], 1):,.1f} us each on average"))
        shares.append(("small ops (norms, rotary, copies, sampling, indexing)", small, top_other))
    below = max(heavy - floor, 0.0)
    shares.append(("the matmul and attention kernels below the roofs", below,
                   f"they take {heavy:.0%} of the step; at the roof the step would take "
                   f"{floor:.0%} of it"))
    shares.sort(key=lambda t: -t[1])
    return shares


def _roofs(s: dict) -> str:
    if s.get("mbu") is None or s.get("mfu") is None:
        return "roof fractions unknown (no peak rates for this device)"
    return f"{s['mbu']:.0%} of the bandwidth roof, {s['mfu']:.0%} of the FLOP roof"


def _verdict(s: dict, compute_dtype: str) -> tuple[str, list[str]]:
    """The verdict and its evidence; s["verdict_line"] gets the verdict with its numbers."""
    verdict, evidence, why = _judge(s, compute_dtype)
    s["verdict_line"] = f"{verdict}: {why}" if why else verdict
    return verdict, evidence


def _judge(s: dict, compute_dtype: str) -> tuple[str, list[str], str]:
    evidence = []
    kv = s["kv"]
    if kv["preemptions_run"] > 0 or kv["steps_waiting_on_full_pool"] > 0:
        evidence.append(
            f"{kv['preemptions_run']} preemption(s) during the run "
            f"({kv['preemptions_measured']} in the timed and profiled steps); "
            f"{kv['steps_waiting_on_full_pool']} step(s) left requests waiting for KV room (the pool "
            f"over {KV_FULL_USAGE:.0%} used, or too full to keep room for the running requests' "
            f"growth; peak {kv['peak_usage']:.0%} of {kv['num_blocks']} blocks of "
            f"{kv['block_size']} tokens)")
        evidence.append("more KV blocks (--num-blocks, --gpu-memory-utilization), fewer concurrent "
                        "sequences (--max-num-seqs) or a smaller KV dtype would let the batch run whole")
        return "KV-capacity-bound", evidence, _roofs(s)
    mbu, mfu = s.get("mbu"), s.get("mfu")
    if mbu is not None and mfu is not None:
        if s["cpu_run"]:
            peaks = f"this CPU, measured: {s['peak_gbps']:,.1f} GB/s, {s['peak_tflops'] * 1e3:,.1f} GFLOP/s"
        else:
            peaks = f"{s['gpu']}: {s['peak_gbps']:,.0f} GB/s, {s['peak_tflops']:,.0f} TFLOP/s {compute_dtype}"
        evidence.append(f"the step moves {s['bytes_per_step'] / 1e6:,.1f} MB and does "
                        f"{s['flops_per_step'] / 1e9:,.4g} GFLOP (step_cost): {s['achieved_gbps']:,.1f} "
                        f"GB/s = {mbu:.1%} of peak bandwidth, {s['achieved_gflops']:,.1f} GFLOP/s = "
                        f"{mfu:.1%} of peak FLOP/s ({peaks})")
        if max(mbu, mfu) >= NEAR_ROOF:
            if mbu >= mfu:
                evidence.append("bandwidth is the nearer roof: batching more sequences per step, or "
                                "smaller weights / KV (quantization), buys throughput")
                return "memory-bound", evidence, _roofs(s)
            evidence.append("the FLOP rate is the nearer roof: faster kernels or lower-precision "
                            "math buy throughput")
            return "compute-bound", evidence, _roofs(s)
        evidence.append(f"both under {NEAR_ROOF:.0%}: neither memory nor arithmetic limits this "
                        f"step; what does is below")
    shares = time_shares(s)
    if not shares:
        evidence.append("no trace of the device's kernels: where the time goes is unknown")
        return "undetermined", evidence, _roofs(s)
    for what, share, detail in shares:
        evidence.append(f"{what}: {share:.0%} of the step" + (f" ({detail})" if detail else ""))
    what, share, _ = shares[0]
    if what.startswith("the matmul"):
        evidence.append("the heavy kernels themselves are slow for this shape: a kernel made for "
                        "it (weight-only quantized GEMV, a fused or compiled step), or more "
                        "sequences per step")
        verdict = "kernel-bound"
    else:
        evidence.append("per-step time goes to overhead, not to the work the model must do: "
                        "fewer, fused ops per step (a compiled or graph-captured step), less "
                        "Python per step, or a larger batch to spread it over")
        verdict = "CPU/launch-bound"
    return verdict, evidence, f"{what} {share:.0%} of the step; {_roofs(s)}"


# ---- printing --------------------------------------------------------------------------------


def format_summary(s: dict) -> str:
    lines = []
    lines.append(f"rooflm profile: {s['model']} on {s['device']} ({s['dtype']}), batch "
                 f"{s['batch_size']} x {s['input_len']} prompt tokens, max {s['output_len']} output "
                 f"tokens; {s['warmup_steps']} warm-up + {s['timed_steps']} timed + "
                 f"{s['profiled_steps']} profiled steps")
    if s["cpu_run"]:
        lines.append("CPU run: GPU figures not applicable")
    lines.append(f"trace: {s['trace']}  (open in https://ui.perfetto.dev or chrome://tracing)")
    lines.append("")
    lines.append(f"wall time per step: {s['step_ms']:.2f} ms (median {s['step_ms_median']:.2f}, "
                 f"without the profiler); {s['step_ms_profiled']:.2f} ms under the profiler")
    lines.append(f"tokens per step: {s['tokens_per_step']:.1f} through the layers, "
                 f"{s['sampled_per_step']:.1f} sampled -> {s['tokens_per_s']:,.1f} tokens/s, "
                 f"{s['sampled_per_s']:,.1f} generated tokens/s")
    busy = s["gpu_busy_fraction"]
    if s["cpu_run"]:
        lines.append("GPU busy fraction: n/a (CPU run)")
    elif busy is None:
        lines.append("GPU busy fraction: no device events in the trace")
    else:
        lines.append(f"GPU busy fraction: {busy:.1%} (union of kernel intervals over the profiled "
                     f"wall time)")
    lines.append("")
    lines.append("CPU time per step by phase (timed steps, exclusive):")
    labels = dict(PHASES)
    total = s["step_ms"] or 1e-12
    for name, ms in s["phase_ms_per_step"].items():
        lines.append(f"  {labels.get(name, name):<52} {ms:>9.3f} ms {ms / total:>6.1%}")
    lines.append("")
    steps = s["profiled_steps"]
    if not s["cpu_run"] and s.get("device_trace"):
        dev = s["device_trace"]
        lines.append("GPU time per step by kernel class (profiled steps):")
        window = dev["window_us"]
        for cls, us in sorted(dev["by_class_us"].items(), key=lambda kv: -kv[1]):
            lines.append(f"  {cls:<52} {us / 1e3 / steps:>9.3f} ms {us / window:>6.1%}")
        lines.append("  top kernels: " + "; ".join(
            f"{name[:60]} {us / 1e3 / steps:.3f} ms" for name, us in dev["top_kernels_us"][:4]))
        kernel_us = sum(us for cls, us in dev["by_class_us"].items() if cls != "idle gaps")
        if kernel_us > window:
            lines.append("  (kernels overlap: with programmatic dependent launch a kernel starts while the one "
                         "before it drains, and its time includes waiting for it)")
    else:
        lines.append("CPU time per step by op class (self time of ops, profiled steps):")
        ops = s["cpu_ops"]
        wall_us = s["step_ms_profiled"] * 1e3 * steps or 1e-12
        rows = dict(ops["by_class_us"])
        rows["outside aten ops (Python, framework, profiler)"] = max(wall_us - ops["ops_self_us"], 0.0)
        for cls, us in sorted(rows.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {cls:<52} {us / 1e3 / steps:>9.3f} ms {us / wall_us:>6.1%}")
        lines.append("  top ops: " + "; ".join(
            f"{name} {us / 1e3 / steps:.3f} ms" for name, us, _ in ops["top_ops"][:4]))
    lines.append("")
    kv = s["kv"]
    lines.append(f"KV cache: {kv['num_blocks']} blocks of {kv['block_size']} tokens, peak usage "
                 f"{kv['peak_usage']:.0%}; preemptions {kv['preemptions_run']} "
                 f"({kv['preemptions_measured']} in the measured steps); steps waiting on a full "
                 f"pool {kv['steps_waiting_on_full_pool']}")
    if s.get("mbu") is not None:
        what = "of measured CPU peaks" if s["cpu_run"] else f"of {s['gpu']}"
        lines.append(f"roofline: {s['bytes_per_step'] / 1e6:,.1f} MB and {s['flops_per_step'] / 1e9:,.4g} "
                     f"GFLOP per step -> {s['achieved_gbps']:,.1f} GB/s, {s['achieved_gflops']:,.1f} "
                     f"GFLOP/s: bandwidth {s['mbu']:.1%}, FLOP/s {s['mfu']:.1%} {what}")
    if s.get("expert_load"):
        lines += format_expert_load(s["expert_load"])
    for note in s.get("notes", []):
        lines.append(f"note: {note}")
    lines.append("")
    lines.append(f"verdict: {s.get('verdict_line', s['verdict'])}")
    for e in s["evidence"]:
        lines.append(f"  - {e}")
    return "\n".join(lines) + "\n"


def run_profile(args: argparse.Namespace, out: Optional[TextIO] = None) -> int:
    """The `rooflm profile` subcommand."""
    from rooflm.engine.llm_engine import LLMEngine

    out = out or sys.stdout
    threads = getattr(args, "threads", None)
    previous_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        engine = LLMEngine.from_kwargs(**engine_kwargs(args))
        summary = profile_engine(
            engine, batch_size=args.batch_size, input_len=args.input_len,
            output_len=args.output_len, steps=args.steps, warmup_steps=args.warmup_steps,
            output_dir=args.output, seed=getattr(args, "seed", 0) or 0, temperature=args.temperature,
            gpu=args.gpu)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"rooflm profile: error: {exc}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(previous_threads)
    out.write(format_summary(summary))
    out.write(f"summary: {summary['summary_json']}\n")
    return 0
