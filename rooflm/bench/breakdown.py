"""Where a run's time goes, step by step: `rooflm bench throughput --breakdown`.

An engine observer (engine.add_observer) keeps every StepReport of the run.
Steps are grouped by kind (decode-only, mixed: prefill chunks beside decodes,
prefill-only) and by how the forward ran (one CUDA graph, piecewise graphs
around eager attention, eager). For each group it prints the wall time the steps took, the
floor the roofline model gives for the same batches (each step's bytes over
the peak bandwidth or its FLOPs over the peak FLOP rate, whichever is larger:
the StepMeter's step_cost: the roofline floor, as if every operation's bytes and
FLOPs could overlap), the serial floor (each operation at its own roof, one after
another, as kernels run: what a step can reach without running a memory-bound
kernel such as attention beside a compute-bound GEMM), and the host's time by phase. With async
scheduling the host's work for step t+1 overlaps the device's work for step t,
so a step whose host phases add up to more than its floor is host-bound: the
device waited for Python.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

from rooflm.engine.report import StepReport
from rooflm.perf.live import StepMeter

def step_kind(report: StepReport) -> str:
    """decode / mixed / prefill, and how the forward ran: one graph, piecewise graphs, eager."""
    return f"{report.kind} ({report.graph})"


@dataclass
class KindTotals:
    steps: int = 0
    elapsed_s: float = 0.0
    floor_s: float = 0.0  # sum over steps of max(bytes / bandwidth, FLOPs / peak)
    serial_floor_s: float = 0.0  # sum over steps and operations of each operation's floor
    seqs: int = 0
    tokens: int = 0
    prefill_tokens: int = 0
    schedule_s: float = 0.0
    launch_s: float = 0.0
    wait_s: float = 0.0
    process_s: float = 0.0
    host_bound_steps: int = 0  # host phases longer than the step's floor
    by_batch: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0.0]))  # seq bucket -> [steps, s]

    def add(self, report: StepReport, floor_s: Optional[float], serial_floor_s: float = 0.0) -> None:
        t = report.timings
        self.steps += 1
        self.elapsed_s += t.elapsed_s
        self.seqs += report.num_seqs
        self.tokens += report.shape.num_tokens
        self.prefill_tokens += report.shape.prefill_tokens
        self.schedule_s += t.schedule_s
        self.launch_s += t.launch_s
        self.wait_s += t.wait_s
        self.process_s += t.process_s
        if floor_s is not None:
            self.floor_s += floor_s
            self.serial_floor_s += serial_floor_s
            if t.schedule_s + t.launch_s + t.process_s > floor_s:
                self.host_bound_steps += 1
        bucket = self.by_batch[32 * (report.num_seqs // 32)]
        bucket[0] += 1
        bucket[1] += t.elapsed_s


class StepBreakdown:
    """Collects StepReports (use `observe` as the engine observer) and sums them by kind."""

    def __init__(self, meter: Optional[StepMeter] = None):
        self.meter = meter  # with a GPU spec: floors per step; without, no floor column
        self.totals: dict[str, KindTotals] = defaultdict(KindTotals)
        self._serial_cache: dict[tuple, float] = {}

    def observe(self, report: StepReport) -> None:
        floor = None
        serial = 0.0
        if self.meter is not None and self.meter.gpu is not None:
            cost = self.meter.record(report.shape, report.timings.elapsed_s)
            floor = max(cost.bytes / self.meter.gpu.mem_bw,
                        cost.flops / self.meter.gpu.peak_flops(self.meter.compute_dtype))
            serial = self._serial_floor(report)
        self.totals[step_kind(report)].add(report, floor, serial)

    def _serial_floor(self, report: StepReport) -> float:
        """The step's operations each at its own roof, in sequence (cached by shape: a run
        repeats shapes, and the full cost model is ~100 us of Python)."""
        key = tuple(sorted(report.shape.as_kwargs().items()))
        if key not in self._serial_cache:
            self._serial_cache[key] = self.meter.cost(report.shape).floor_seconds(self.meter.gpu)
        return self._serial_cache[key]

    def as_dict(self) -> dict:
        out = {}
        for kind, t in sorted(self.totals.items()):
            if not t.steps:
                continue
            out[kind] = {
                "steps": t.steps, "elapsed_s": t.elapsed_s, "floor_s": t.floor_s if self.meter else None,
                "serial_floor_s": t.serial_floor_s if self.meter else None,
                "mean_seqs": t.seqs / t.steps, "tokens": t.tokens, "prefill_tokens": t.prefill_tokens,
                "host_ms_per_step": {name: 1e3 * getattr(t, f"{name}_s") / t.steps
                                     for name in ("schedule", "launch", "wait", "process")},
                "host_bound_steps": t.host_bound_steps,
                "by_batch": {f"{b}-{b + 31}": {"steps": n, "elapsed_s": s}
                             for b, (n, s) in sorted(t.by_batch.items())},
            }
        return out

    def format(self) -> str:
        total = sum(t.elapsed_s for t in self.totals.values()) or 1e-12
        has_floor = self.meter is not None and self.meter.gpu is not None
        lines = [" Step breakdown ".center(126, "-"),
                 f"{'kind':<20}{'steps':>6}{'time s':>8}{'share':>7}{'floor s':>9}{'serial s':>9}{'ms/step':>9}"
                 f"{'seqs':>6}{'tok/step':>9}   host ms/step: {'sched':>6}{'launch':>7}{'wait':>6}"
                 f"{'proc':>6}{'host>floor':>11}"]
        for kind, t in sorted(self.totals.items()):
            if not t.steps:
                continue
            per = 1e3 / t.steps
            floor = f"{t.floor_s:9.2f}{t.serial_floor_s:9.2f}" if has_floor else f"{'-':>9}{'-':>9}"
            bound = f"{t.host_bound_steps:>11}" if has_floor else f"{'-':>11}"
            lines.append(
                f"{kind:<20}{t.steps:>6}{t.elapsed_s:>8.2f}{t.elapsed_s / total:>7.0%}{floor}"
                f"{t.elapsed_s * per:>9.2f}{t.seqs / t.steps:>6.0f}{t.tokens / t.steps:>9.0f}"
                f"   {'':>13}{t.schedule_s * per:>6.2f}{t.launch_s * per:>7.2f}{t.wait_s * per:>6.2f}"
                f"{t.process_s * per:>6.2f}{bound}")
        lines.append("time: wall time of the steps; floor: the same batches at the peak rates, bytes and FLOPs "
                     "overlapped; serial: each operation at its own roof, one after another; host>floor: "
                     "steps whose host work (schedule + launch + process) took longer than their floor")
        return "\n".join(lines) + "\n"
