"""The engine's numbers for operators: each step's cost in Prometheus, and a periodic log line.

One step-cost model serves both: a perf/live.StepMeter (the analytic model of
`rooflm roofline`) turns each StepReport the engine hands its observers into
bytes, FLOPs, MBU and MFU; the observer passes them to the metrics, and the log
line prints the meter's rolling summary. MBU and MFU need the device's peaks:
the GPU table's entry for the device, or only a bandwidth (--peak-bandwidth-gbs).
Without either the gauges stay absent rather than show a made-up number.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Optional

from rooflm.engine.client import EngineClient
from rooflm.engine.report import EngineInfo, EngineSnapshot
from rooflm.perf.gpus import GpuSpec
from rooflm.perf.live import MeterSummary, StepMeter, default_gpu_for
from rooflm.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


def with_bandwidth(gpu: Optional[GpuSpec], bandwidth_gbs: float) -> GpuSpec:
    """The GPU's peaks with its memory bandwidth replaced (a measured or known figure)."""
    if gpu is None:
        # A device the table lacks: only the bandwidth is known. A peak of 0 FLOP/s is
        # the meter's "unknown": MBU without MFU.
        gpu = GpuSpec(key="custom", name="a device the GPU table lacks", peak_tflops={"fp32": 0.0})
    return dataclasses.replace(gpu, mem_bw_gbs=bandwidth_gbs, source="--peak-bandwidth-gbs")


def step_gpu(info: EngineInfo, peak_bandwidth_gbs: float) -> Optional[GpuSpec]:
    """The peaks MBU and MFU are measured against; None when nothing is known (a CPU)."""
    gpu = default_gpu_for(info.device)
    if peak_bandwidth_gbs > 0:
        return with_bandwidth(gpu, peak_bandwidth_gbs)
    return gpu


def attach_step_meter(engine, metrics: ServerMetrics, peak_bandwidth_gbs: float) -> StepMeter:
    """A StepMeter fed every step the engine runs; each step's stats go to the metrics."""
    meter = StepMeter.for_engine(engine.info, step_gpu(engine.info, peak_bandwidth_gbs))
    # After each step (on the engine thread, or on the event loop as the engine core's
    # reports arrive): one affine evaluation and a few gauge sets. Data-parallel replicas
    # (dp/replicas.py) share the meter (the log line sums them) and keep their own series.
    for index, core in enumerate(getattr(engine, "replicas", [engine])):
        target = metrics.for_engine(str(index)) if index else metrics
        core.add_observer(lambda report, target=target: target.record_step(meter.observe(report)))
    return meter


def stats_line(before: EngineSnapshot, after: EngineSnapshot, seconds: float,
               summary: MeterSummary) -> str:
    """The queues and the KV pool now; tokens and prefix hits since `before`; the steps' cost."""
    tokens_per_s = (after.generation_tokens - before.generation_tokens) / max(seconds, 1e-9)
    queried = after.prefix_queried_tokens - before.prefix_queried_tokens
    hits = after.prefix_hit_tokens - before.prefix_hit_tokens
    hit_rate = hits / queried if queried else 0.0
    host_hits = after.prefix_host_hit_tokens - before.prefix_host_hit_tokens
    host = f" ({100 * host_hits / hits:.0f}% from host memory)" if host_hits else ""
    waiting = after.num_waiting_reqs + after.num_swapped_reqs
    return (f"running: {after.num_running_reqs} reqs, waiting: {waiting} reqs, KV cache usage: "
            f"{100 * after.kv_usage:.1f}%, generation: {tokens_per_s:.1f} tokens/s, prefix cache "
            f"hit rate: {100 * hit_rate:.1f}%{host}; steps: {summary.format()}")


async def log_stats_forever(engine_client: EngineClient, meter: StepMeter, interval: float) -> None:
    """Every `interval` seconds, one line about that interval (INFO while busy, else DEBUG)."""
    before, last_time = engine_client.snapshot, time.monotonic()
    while True:
        await asyncio.sleep(interval)
        # The front replaces the snapshot whole: this is one consistent state.
        after, now = engine_client.snapshot, time.monotonic()
        summary = meter.summary()
        meter.reset()
        busy = (after.num_running_reqs or after.num_waiting_reqs
                or after.generation_tokens > before.generation_tokens)
        log = logger.info if busy else logger.debug
        log("%s", stats_line(before, after, now - last_time, summary))
        before, last_time = after, now
