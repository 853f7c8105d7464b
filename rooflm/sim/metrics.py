"""A simulation's figures, computed by the very code `rooflm bench serve` computes them with.

Each simulated request becomes a bench-serve RequestOutput (send time, first-token time,
one chunk per token, end), and perf.serving_metrics.compute_metrics makes throughput, goodput and
the TTFT/TPOT/ITL/E2EL percentiles from them: a simulated and a measured run are compared
figure for figure. The simulator adds what only it sees: time queued before the first
schedule, preemptions, and the KV pool's usage and the queues over time.
"""

from __future__ import annotations

import bisect
import math
from typing import Optional

from rooflm.perf.serving_metrics import RequestOutput, compute_metrics, histogram_quantile, stats
from rooflm.server.buckets import TTFT_BUCKETS
from rooflm.sim.simulator import SimResult


def bench_outputs(result: SimResult, egress_s: float = 0.0) -> list[RequestOutput]:
    outputs = []
    for rec in result.records:
        if rec.error or rec.finish_s is None or not rec.token_times:
            outputs.append(RequestOutput(success=False, error=rec.error or "never finished",
                                         prompt_len=rec.prompt_len, start=rec.arrival_s))
            continue
        times = [t + egress_s for t in rec.token_times]
        outputs.append(RequestOutput(
            success=True, prompt_len=rec.prompt_len, output_tokens=len(times),
            ttft=times[0] - rec.arrival_s, chunks=len(times),
            latency=rec.finish_s + egress_s - rec.arrival_s,
            itl=[b - a for a, b in zip(times, times[1:])], start=rec.arrival_s, chunk_times=times))
    return outputs


def server_ttft_ms(result: SimResult) -> Optional[dict]:
    """TTFT as the server's /metrics histogram reports it (bench serve's server_ttft_ms): from
    the API process taking the request in to its taking in the step with the first token (the
    token's streaming, and any wait before the request was taken in, are not in it), counted into
    the server's buckets and read back with the same interpolation, so that simulated and
    measured quantiles are equally coarse."""
    values = sorted(r.first_token_server_s - r.admitted_s for r in result.records
                    if r.first_token_server_s is not None and r.admitted_s is not None)
    if not values:
        return None
    cumulative = {le: float(bisect.bisect_right(values, le)) for le in TTFT_BUCKETS}
    cumulative[math.inf] = float(len(values))
    return {"median": histogram_quantile(0.5, cumulative) * 1e3, "p99": histogram_quantile(0.99, cumulative) * 1e3,
            "count": len(values)}


def _downsample(points: list, limit: int) -> list:
    if len(points) <= limit:
        return points
    stride = len(points) / limit
    return [points[int(i * stride)] for i in range(limit)]


def sim_metrics(result: SimResult, goodput_slos: Optional[dict[str, float]] = None,
                series_points: int = 2000) -> dict:
    """bench serve's metrics dict, plus the simulator's own figures under "sim"."""
    metrics = compute_metrics(bench_outputs(result), result.duration_s, goodput_slos or {})
    metrics["server_ttft_ms"] = server_ttft_ms(result)
    queued = [1e3 * (r.scheduled_s - r.arrival_s) for r in result.records if r.scheduled_s is not None]
    series = []
    for replica in result.replicas:
        for s in replica.steps:
            series.append((s.start_s, replica.index, s.kv_usage, s.num_running, s.num_waiting))
    series.sort()
    per_replica = []
    for replica in result.replicas:
        steps = replica.steps
        per_replica.append({
            "steps": replica.num_steps, "busy_s": replica.busy_s,
            "busy_fraction": replica.busy_s / result.duration_s if result.duration_s else 0.0,
            "preemptions": replica.num_preemptions,
            "requests": sum(1 for r in result.records if r.replica == replica.index),
            "mean_seqs_per_step": (sum(s.num_running for s in steps) / len(steps)) if steps else None,
            "peak_kv_usage": max((s.kv_usage for s in steps), default=0.0),
            "prefix_hit_tokens": replica.block_manager.prefix_hits,
        })
    metrics["sim"] = {
        "steps": result.num_steps, "preemptions": result.num_preemptions,
        "queue_ms": stats(queued),
        "requests_preempted": sum(1 for r in result.records if r.num_preemptions),
        "cached_prompt_tokens": sum(r.num_cached_tokens for r in result.records),
        "replicas": per_replica,
        "kv_usage_series": [{"t": t, "replica": i, "kv_usage": round(u, 4), "running": run, "waiting": w}
                            for t, i, u, run, w in _downsample(series, series_points)],
        "wall_s": result.wall_s,
    }
    return metrics
