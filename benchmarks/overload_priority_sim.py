"""Issue 54's overload targets on the simulator: the engine's own scheduler and block manager, the
H200 step costs (the H100 calibration carried over by the roofline), no GPU. The CPU check of what
benchmarks/overload_priority.py measures through real servers, and the reproduction behind the
priority and SLO-admission changes of the scheduler and step_cost.py.

The traffic is overload_priority.py's: prompts 512 +- 50%, outputs 128 +- 50% tokens, Poisson
arrivals at --rate for --duration-s, --high-share of them priority 0 (the rest 1). Rows:
  priority unloaded   the high-priority requests alone, at their own arrival times
  priority overload   everything, --scheduling-policy priority
  fcfs overload       everything, fcfs: the goodput baseline
  slo overload        everything, fcfs with --ttft-slo-ms: shed requests count as not good
for each step token budget in --budgets. The API process is modelled (sim/api_process.py).

    python benchmarks/overload_priority_sim.py                 # ~1 min on a laptop core
    python benchmarks/overload_priority_sim.py --budgets 1024 --rate 84
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rooflm.sim import commands  # noqa: E402
from rooflm.sim.api_process import API_TOKEN_S, ApiCost  # noqa: E402
from rooflm.sim.simulator import SimConfig, simulate  # noqa: E402
from rooflm.sim.workload import SimRequest  # noqa: E402

HIGH, LOW = 0, 1


def engine_args(budget: int) -> argparse.Namespace:
    """`rooflm simulate`'s defaults for one H200 replica of the 8B, at this step budget."""
    return argparse.Namespace(
        max_num_seqs=None, block_size=None, max_model_len=4096, max_num_batched_tokens=budget,
        enable_chunked_prefill=True, preemption_mode="recompute", reserve_new_tokens=True, num_blocks=None,
        kv_cache_dtype="auto", weight_dtype="bf16", gpu_memory_utilization=0.9, async_scheduling=None,
        swap_space_gb=4, enable_prefix_caching=True, kv_offload_gb=0, calibration=None, no_calibration=False)


def workload(args) -> list[SimRequest]:
    rng = random.Random(args.seed)
    requests, t = [], 0.0
    spread = lambda mean: rng.randint(int(mean * (1 - args.range_ratio)), int(mean * (1 + args.range_ratio)))  # noqa: E731
    while True:
        t += rng.expovariate(args.rate)
        if t > args.duration_s:
            return requests
        priority = HIGH if rng.random() < args.high_share else LOW
        requests.append(SimRequest(t, spread(args.input_len), spread(args.output_len), priority=priority))


def run(args, budget: int, requests: list[SimRequest], policy: str, slo_ms: float = 0.0) -> list:
    ns = engine_args(budget)
    _, model = commands.model_config_of("llama-3-8b")
    tables = commands._tables(ns)
    cfg, _ = commands.replica_config(ns, model, "h200", 1, tables)
    cfg = replace(cfg, scheduler=replace(cfg.scheduler, scheduling_policy=policy), ttft_slo_ms=slo_ms)
    cost, _ = commands.cost_model_for(ns, model, "h200", 1, tables, cfg.async_scheduling)
    if policy == "fcfs":
        requests = [replace(r, priority=0) for r in requests]
    result = simulate(SimConfig(cfg, api=ApiCost(token_s=API_TOKEN_S)), cost, requests)
    return result.records


def summary(records: list, classes: list[int], keep, args) -> dict:
    def pct(xs, q):
        return 1e3 * xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None
    recs = [r for r, c in zip(records, classes) if keep is None or c == keep]
    ok = [r for r in recs if not r.error and r.token_times]
    ttft = sorted(r.token_times[0] - r.arrival_s for r in ok)
    tpot = sorted((r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) for r in ok if len(r.token_times) > 1)
    good = sum(1 for r in ok if r.token_times[0] - r.arrival_s <= args.ttft_slo_ms / 1e3
               and (len(r.token_times) < 2 or (r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1)
                    <= args.tpot_slo_ms / 1e3))
    return {"sent": len(recs), "shed": sum(1 for r in recs if r.error.startswith("shed")),
            "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99), "tpot_p50": pct(tpot, 0.5), "good": good}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budgets", type=int, nargs="+", default=[2048, 1024], help="max_num_batched_tokens")
    p.add_argument("--rate", type=float, default=80.0, help="req/s (1.5x the H200's measured 53.4 req/s)")
    p.add_argument("--duration-s", type=float, default=15.0)
    p.add_argument("--high-share", type=float, default=0.2)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--ttft-slo-ms", type=float, default=500.0)
    p.add_argument("--tpot-slo-ms", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    requests = workload(args)
    classes = [r.priority for r in requests]
    high = [r for r in requests if r.priority == HIGH]
    print("| budget | run | class | sent | shed | TTFT P50 ms | TTFT P99 ms | TPOT P50 ms | good |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")

    def row(budget, name, label, s):
        ms = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        print(f"| {budget} | {name} | {label} | {s['sent']} | {s['shed']} | {ms(s['ttft_p50'])} | "
              f"{ms(s['ttft_p99'])} | {ms(s['tpot_p50'])} | {s['good']} |", flush=True)

    for budget in args.budgets:
        unloaded = summary(run(args, budget, high, "priority"), [HIGH] * len(high), None, args)
        row(budget, "priority unloaded", "high", unloaded)
        records = run(args, budget, requests, "priority")
        loaded = summary(records, classes, HIGH, args)
        row(budget, "priority overload", "high", loaded)
        row(budget, "priority overload", "low", summary(records, classes, LOW, args))
        fcfs = summary(run(args, budget, requests, "fcfs"), classes, None, args)
        row(budget, "fcfs overload", "all", fcfs)
        slo = summary(run(args, budget, requests, "fcfs", args.ttft_slo_ms), classes, None, args)
        row(budget, f"slo {args.ttft_slo_ms:g} overload", "all", slo)
        print(f"budget {budget}: high-priority P99 TTFT {loaded['ttft_p99']:.1f} / {unloaded['ttft_p99']:.1f} ms = "
              f"{loaded['ttft_p99'] / unloaded['ttft_p99']:.2f}x (<= 2x); goodput {slo['good']} / {fcfs['good']} = "
              f"{slo['good'] / max(fcfs['good'], 1):.2f}x (>= 1.3x)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
