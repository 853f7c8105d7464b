"""`rooflm simulate`: serving simulated over the engine's own scheduler (run, --calibrate, --plan).

  rooflm simulate --model llama-3-8b --gpu h100 --request-rate 16 32 48 --num-prompts 1000 \\
      --input-len 230 --output-len 200 --range-ratio 0.9
  rooflm simulate --trace serve-result.json          # replay a `bench serve` run's traffic
  rooflm simulate --calibrate --model DIR --load-format dummy --calibration-out h100.json
  rooflm simulate --plan --rate 200 --slo ttft_p99=500ms,tpot_p50=30ms --gpus h100,h200

The engine flags (--max-num-seqs, --max-num-batched-tokens, --block-size, ...) are the
engine's own and mean the same here: a simulated replica runs that configuration.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Optional, TextIO

from rooflm.config import CUDA_BLOCK_SIZE, SchedulerConfig, kv_blocks_cap, resolve_max_num_seqs
from rooflm.dp.router import POLICIES
from rooflm.engine_args import add_engine_args, engine_kwargs

# Host-to-device copies of KV blocks (swaps, the prefix cache's host tier) over PCIe 5 x16,
# pinned, as measured rates go (~50 of 64 GB/s).
HOST_LINK_GBS = 50.0


def register(sub) -> None:

    p = sub.add_parser(
        "simulate", help="simulate serving on the engine's own scheduler: run, --calibrate, --plan",
        description="Discrete-event simulation of serving: the engine's scheduler and block manager "
                    "over a calibrated roofline step-cost model, for one GPU or many (TP, DP).")
    mode = p.add_argument_group("mode")
    mode.add_argument("--calibrate", action="store_true",
                      help="time real engine steps on this machine's GPU and write a calibration table")
    mode.add_argument("--plan", action="store_true",
                      help="search GPU types, TP and DP for the cheapest layouts meeting --slo at --rate")
    hw = p.add_argument_group("hardware and cost model")
    hw.add_argument("--gpu", default=None, help="GPU table key (h100, h200, a100, ...); default h100, "
                    "or the GPU present for --calibrate")
    # A replica's tensor-parallel degree and KV dtype are the engine flags' own
    # (--tensor-parallel-size / -tp, --kv-cache-dtype), as `rooflm serve` takes them.
    hw.add_argument("--data-parallel-size", "-dp", dest="data_parallel_size", type=int, default=1,
                    help="data-parallel replicas behind the router (as `rooflm serve`)")
    hw.add_argument("--dp-routing", default="least_loaded", choices=POLICIES,
                    help="how a request picks its replica: the server's router (rooflm/dp/router.py)")
    hw.add_argument("--weight-dtype", default="bf16", help="bf16 | fp16 | fp8 | int8 | int4 | fp32")
    hw.add_argument("--calibration", default=None, metavar="FILE",
                    help="calibration table (default: the shipped tables, closest GPU)")
    hw.add_argument("--no-calibration", action="store_true",
                    help="price steps at the bare datasheet roofline")
    hw.add_argument("--ingress-ms", type=float, default=None,
                    help="API-process latency before a request reaches the engine (default 2.2 ms: "
                         "measured `rooflm serve` vs offline TTFT; 0 for offline workloads)")
    hw.add_argument("--api-token-us", type=float, default=None,
                    help="API-process CPU per streamed token, per-request work included (default 67 "
                         "us: measured behind `rooflm serve` on the H100 host; 0 for offline workloads)")
    hw.add_argument("--api-request-us", type=float, default=0.0,
                    help="API-process CPU per request on top of --api-token-us (default 0)")
    wl = p.add_argument_group("workload")
    wl.add_argument("--trace", default=None, metavar="FILE",
                    help="JSON/CSV trace (arrival_s, prompt_len, output_len[, max_tokens, prefix_group, "
                         "prefix_len]) or a `rooflm bench serve` result file to replay")
    wl.add_argument("--num-prompts", type=int, default=1000)
    wl.add_argument("--request-rate", "--rate", dest="request_rate", type=float, nargs="+",
                    default=[math.inf], metavar="RATE", help="requests/s (inf: all at once); several: a sweep")
    wl.add_argument("--arrival", default="poisson", choices=("poisson", "gamma", "burst", "offline"))
    wl.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (--arrival gamma)")
    wl.add_argument("--burst-size", type=int, default=10, help="requests per burst (--arrival burst)")
    wl.add_argument("--input-len", type=int, default=230)
    wl.add_argument("--output-len", type=int, default=200)
    wl.add_argument("--input-dist", default="uniform", choices=("fixed", "uniform", "lognormal"))
    wl.add_argument("--output-dist", default="uniform", choices=("fixed", "uniform", "lognormal"))
    wl.add_argument("--range-ratio", type=float, default=0.9, help="uniform lengths: mean x [1-r, 1+r]")
    wl.add_argument("--sigma", type=float, default=1.0, help="lognormal lengths: sigma")
    wl.add_argument("--num-prefixes", type=int, default=0, help="shared-prefix groups (0: none)")
    wl.add_argument("--prefix-len", type=int, default=0, help="tokens of each shared prefix")
    wl.add_argument("--seed", type=int, default=0)
    res = p.add_argument_group("results")
    res.add_argument("--goodput", nargs="+", default=None, metavar="SLO",
                     help="per-request SLOs in ms for goodput, as bench serve: ttft:500 tpot:30")
    res.add_argument("--result-file", default=None, help="write the result as JSON")
    res.add_argument("--plot", default=None, metavar="FILE.png",
                     help="latency distributions, throughput, KV usage and queues over time; with "
                          "several rates, FILE-rateR.png per rate and FILE.png against the rate")
    res.add_argument("--calibration-out", default=None, metavar="FILE", help="--calibrate: where to write")
    pl = p.add_argument_group("plan")
    pl.add_argument("--slo", default=None, help="--plan: e.g. ttft_p99=500ms,tpot_p50=30ms")
    pl.add_argument("--gpus", default="h100,h200", help="--plan: GPU types to consider")
    pl.add_argument("--tp-options", default="1,2,4,8", help="--plan: TP degrees to consider")
    pl.add_argument("--price", default=None, help="--plan: prices per GPU-hour, e.g. h100=2.49,h200=3.8")
    pl.add_argument("--top", type=int, default=3, help="--plan: layouts to print")
    pl.add_argument("--gpus-per-host", type=int, default=8)
    pl.add_argument("--verbose", action="store_true", help="--plan: print every probe")
    add_engine_args(p)
    p.set_defaults(func=run_simulate)


# ---- building blocks from flags ------------------------------------------------------------


def model_config_of(model: Optional[str]):
    from rooflm.model.loader import load_model_config
    from rooflm.model.presets import PRESETS, get_preset

    if model is None:
        return "llama-3-8b", get_preset("llama-3-8b")
    if model.lower() in PRESETS:
        return model, get_preset(model)
    if os.path.isdir(model):
        return os.path.basename(os.path.normpath(model)), load_model_config(model, "dummy")
    raise ValueError(f"--model must be a preset ({', '.join(sorted(PRESETS))}) or an HF directory with "
                     f"config.json; got {model!r}")


def _tables(args):
    from rooflm.sim.calibration import load_table, shipped_tables

    if args.no_calibration:
        return []
    if args.calibration:
        return [load_table(args.calibration)]
    return shipped_tables()


def kv_dtype(args) -> str:
    """The cost model's KV dtype from --kv-cache-dtype: fp8, or auto's the model's dtype (the
    weights' where they are floats; bf16 activations beside quantized weights)."""
    if args.kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return "fp8"
    return args.weight_dtype if args.weight_dtype in ("bf16", "fp16", "fp32") else "bf16"


def replica_config(args, model, gpu_key: str, tp: int, tables) -> tuple:
    """The engine configuration one replica runs, and where its KV pool size is from."""
    from rooflm.perf.gpus import get_gpu
    from rooflm.engine.kv_groups import blocks_per_seq, single_group
    from rooflm.perf.memory import inference_memory, model_kv_layout
    from rooflm.perf.roofline import KV_CACHE_BYTES, kv_bytes_per_token_per_gpu
    from rooflm.sim.replica import ReplicaConfig

    gpu = get_gpu(gpu_key)
    pp = getattr(args, "pipeline_parallel_size", 1)
    micro_batches = 1 if pp == 1 else (getattr(args, "pipeline_micro_batches", None) or pp)
    max_num_seqs = resolve_max_num_seqs(args.max_num_seqs, "cuda", gpu.mem_gb)
    block_size = args.block_size or CUDA_BLOCK_SIZE  # the engine's CUDA default too
    max_model_len = args.max_model_len or model.max_position_embeddings
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                            max_model_len=max_model_len, enable_chunked_prefill=args.enable_chunked_prefill,
                            preemption_mode=args.preemption_mode, reserve_new_tokens=args.reserve_new_tokens)
    measured = [t for t in tables if t.gpu == gpu.key and t.model == model]
    # The engine's KV cache groups (sliding-window layers hold only their window), except for a
    # pool measured by the engine: its tables record blocks of every layer.
    layout = model_kv_layout(model, max_model_len)
    if args.num_blocks:
        num_blocks, source = args.num_blocks, "--num-blocks"
    elif measured and tp == 1 and kv_dtype(args) == measured[0].kv_dtype:
        # The measured pool in tokens, cut into this run's blocks (tables may be at another block size).
        num_blocks = measured[0].num_blocks * measured[0].block_size // block_size
        source = f"measured by the engine on {measured[0].device_name}"
        layout = single_group(model.num_hidden_layers)
    else:
        mem = inference_memory(model, args.weight_dtype, kv_dtype(args), context=max_model_len,
                               gpu_mem_gb=gpu.mem_gb, tp=tp, block_size=block_size,
                               gpu_memory_utilization=args.gpu_memory_utilization,
                               max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=max_num_seqs,
                               pp=pp)
        num_blocks = mem.num_blocks if pp > 1 else mem.hybrid_num_blocks  # PP: one group (hybrid off)
        layout = mem.kv_layout if pp > 1 else layout
        source = f"perf/memory estimate for {gpu.mem_gb:g} GB x TP {tp}" + (f" x PP {pp}" if pp > 1 else "")
    if layout.hybrid:
        source += f", blocks of {layout.group_size} layers (sliding layers hold their window)"
    # Millions of blocks would take seconds per replica to build, for nothing.
    cap = kv_blocks_cap(max_num_seqs, max_model_len, block_size)
    if layout.hybrid:
        cap = max_num_seqs * blocks_per_seq(layout, max_model_len, block_size)
    if num_blocks > cap:
        num_blocks, source = cap, source + f", capped at {max_num_seqs} full-length sequences"
    async_scheduling = True if args.async_scheduling is None else args.async_scheduling
    num_host_blocks = num_offload_blocks = 0
    block_bytes = block_size * kv_bytes_per_token_per_gpu(model, KV_CACHE_BYTES[kv_dtype(args)], tp)
    block_bytes *= layout.group_size / model.num_hidden_layers / pp
    if args.preemption_mode == "swap":  # the engine's rule: swap space over one block's K/V (one GPU)
        num_host_blocks = int(args.swap_space_gb * 2**30 // block_bytes)
    if args.enable_prefix_caching and args.kv_offload_gb:
        # The engine's rule too; unset is 0 here: the simulated host's memory is not known.
        num_offload_blocks = int(args.kv_offload_gb * 2**30 // block_bytes)
    cfg = ReplicaConfig(sched, num_blocks=max(num_blocks, 0), block_size=block_size,
                        enable_prefix_caching=args.enable_prefix_caching, num_host_blocks=num_host_blocks,
                        num_offload_blocks=num_offload_blocks,
                        host_copy_s_per_block=block_bytes / (HOST_LINK_GBS * 1e9),
                        max_model_len=max_model_len, async_scheduling=async_scheduling,
                        sliding_window=model.sliding_window, kv_windows=layout.windows,
                        pipeline_stages=pp, micro_batches=micro_batches)
    return cfg, source


def cost_model_for(args, model, gpu_key: str, tp: int, tables, async_scheduling: bool):
    from rooflm.perf.gpus import get_gpu
    from rooflm.sim.calibration import correction_for
    from rooflm.sim.cost_model import RooflineCostModel

    gpu = get_gpu(gpu_key)
    correction, note = correction_for(gpu, model, tables)
    return RooflineCostModel(model, gpu, tp, args.weight_dtype, kv_dtype(args), correction,
                             async_scheduling, pp=getattr(args, "pipeline_parallel_size", 1)), note


def workload_for(args, rate: float, num_prompts: Optional[int] = None, seed: Optional[int] = None):
    from rooflm.sim.workload import LengthDist, load_trace, synthetic_workload

    if args.trace:
        return load_trace(args.trace)
    process = "offline" if math.isinf(rate) else args.arrival
    return synthetic_workload(
        num_prompts or args.num_prompts,
        LengthDist(args.input_dist, args.input_len, args.range_ratio, args.sigma),
        LengthDist(args.output_dist, args.output_len, args.range_ratio, args.sigma),
        process, rate, args.burstiness, args.burst_size, args.num_prefixes, args.prefix_len,
        args.seed if seed is None else seed)


def _api_cost(args):
    from rooflm.sim.api_process import API_TOKEN_S, ApiCost

    token_s = API_TOKEN_S if args.api_token_us is None else args.api_token_us / 1e6
    return ApiCost(request_s=args.api_request_us / 1e6, token_s=token_s)


def _ingress_s(args) -> float:
    from rooflm.sim.simulator import SERVER_INGRESS_S

    if args.ingress_ms is not None:
        return args.ingress_ms / 1e3
    return SERVER_INGRESS_S


# ---- the modes --------------------------------------------------------------------------------


def run_simulate(args: argparse.Namespace, out: TextIO = None) -> int:
    out = out or sys.stdout
    try:
        if args.calibrate:
            return _calibrate(args, out)
        if args.plan:
            return _plan(args, out)
        return _run(args, out)
    except (ValueError, OSError) as exc:
        print(f"rooflm simulate: error: {exc}", file=sys.stderr)
        return 2


def _run(args, out: TextIO) -> int:
    from rooflm.perf.serving_metrics import format_report, format_sweep, parse_goodput
    from rooflm.sim.metrics import sim_metrics
    from rooflm.sim.simulator import SimConfig, simulate

    name, model = model_config_of(args.model)
    gpu_key = args.gpu or "h100"
    tables = _tables(args)
    replica, kv_source = replica_config(args, model, gpu_key, args.tensor_parallel_size, tables)
    cost, note = cost_model_for(args, model, gpu_key, args.tensor_parallel_size, tables, replica.async_scheduling)
    slos = parse_goodput(args.goodput)
    rates = [math.inf] if args.trace else list(args.request_rate)
    pp = f" x PP {args.pipeline_parallel_size}" if args.pipeline_parallel_size > 1 else ""
    out.write(f"model {name}; {args.data_parallel_size} x {gpu_key} TP {args.tensor_parallel_size}{pp} ({args.dp_routing} router); "
              f"{replica.num_blocks} KV blocks of {replica.block_size} ({kv_source}); "
              f"max {replica.scheduler.max_num_seqs} seqs, {replica.scheduler.max_num_batched_tokens} "
              f"tokens/step; {'async' if replica.async_scheduling else 'sync'} scheduling\n"
              f"cost model: {cost.describe()}\n  ({note})\n")
    sweep, results = [], []
    for i, rate in enumerate(rates):
        requests = workload_for(args, rate, seed=args.seed + i)
        cfg = SimConfig(replica, args.data_parallel_size, args.dp_routing, _ingress_s(args), model.vocab_size, args.seed,
                        api=_api_cost(args))
        with progress_bar(len(requests), f"simulating {label_of(args, rate)}") as bar:
            result = simulate(cfg, cost, requests, progress=lambda done: bar.update(done - bar.n))
        metrics = sim_metrics(result, slos)
        label = label_of(args, rate)
        out.write(f"{len(requests)} requests, {label}: simulated in {result.wall_s:.1f} s, "
                  f"{result.num_steps} steps, {result.num_preemptions} preemptions\n")
        report_args = argparse.Namespace(max_concurrency=None, request_rate=rate)
        out.write(format_report(metrics, report_args).replace("Serving Benchmark Result",
                                                              "Simulated Serving Result"))
        q = metrics["sim"]["queue_ms"]
        if q:
            out.write(f"{'Queued before first step (ms):':<40} mean {q['mean']:.1f}, median {q['median']:.1f}, "
                      f"P99 {q['p99']:.1f}\n")
        sweep.append(metrics)
        results.append({"request_rate": None if math.isinf(rate) else rate, "num_prompts": len(requests),
                        **metrics})
        if args.plot:
            from rooflm.sim.plot import plot_simulation, rate_path

            # A sweep gives each rate its own files; the --plot name itself is the sweep's chart.
            path = args.plot if len(rates) == 1 else rate_path(args.plot, rate)
            written = plot_simulation(result, metrics, path, title=f"simulated {name} on {args.data_parallel_size} x "
                                                                   f"{gpu_key} TP{args.tensor_parallel_size}, {label}")
            out.write(f"plots written to {', '.join(written)}\n")
    if len(rates) > 1:
        out.write(" Sweep over request rates (simulated) ".center(50, "=") + "\n")
        out.write(format_sweep(rates, sweep))
        if args.plot:
            from rooflm.perf.plot import plot_rate_sweep

            plot_rate_sweep(rates, sweep, args.plot, title=f"simulated {name} on {args.data_parallel_size} x {gpu_key} "
                                                          f"TP{args.tensor_parallel_size}: {args.num_prompts} requests per rate")
            out.write(f"sweep plot (TTFT, TPOT, throughput against the rate) written to {args.plot}\n")
    if args.result_file:
        from rooflm.perf.results import stamp, write_json

        write_json(args.result_file, {
            "simulated": True, **stamp(), "model": name, "gpu": gpu_key, "tp": args.tensor_parallel_size, "dp": args.data_parallel_size,
            "router": args.dp_routing, "cost_model": cost.describe(), "correction_source": note,
            "num_blocks": replica.num_blocks, "num_blocks_source": kv_source,
            "max_num_seqs": replica.scheduler.max_num_seqs,
            "async_scheduling": replica.async_scheduling, "trace": args.trace,
            "results": results})
        out.write(f"result written to {args.result_file}\n")
    return 0 if all(m["completed"] for m in sweep) else 1


def label_of(args, rate: float) -> str:
    return "trace " + args.trace if args.trace else f"{rate:g} req/s ({args.arrival})"


def progress_bar(total: Optional[int], desc: str, unit: str = "req"):
    """A bar on stderr: the report itself goes to `out`, which may be a file or a test's buffer."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, mininterval=1.0, dynamic_ncols=True)


def _calibrate(args, out: TextIO) -> int:
    from rooflm.sim.calibrate import calibrate

    table = calibrate(engine_kwargs(args), args.gpu, seed=args.seed, out=out)
    path = args.calibration_out or f"calibration-{table.gpu}-{os.path.basename(str(table.model_name))}.json"
    table.save(path)
    fit = table.fit
    out.write(f"calibrated {table.device_name} ({table.gpu}) on {table.model_name}: {fit['steps']} steps "
              f"({fit['device_bound_steps']} device-bound); fit error median {fit['median_rel_error']:.1%}, "
              f"P90 {fit['p90_rel_error']:.1%}\n")
    out.write("device coefficients: " + json.dumps(table.to_json()["device_coefficients"]) + "\n")
    out.write("host coefficients (s): " + json.dumps(table.to_json()["host_coefficients"]) + "\n")
    out.write(f"table written to {path}\n")
    return 0


def _plan(args, out: TextIO) -> int:
    from rooflm.perf.roofline import _shard
    from rooflm.sim.plan import SLO, Candidate, Planner, format_plan
    from rooflm.sim.prices import PRICE_SOURCE, parse_prices

    if not args.slo:
        raise ValueError("--plan needs --slo, e.g. ttft_p99=500ms,tpot_p50=30ms")
    rates = list(args.request_rate)
    if len(rates) != 1 or math.isinf(rates[0]):
        raise ValueError("--plan needs one finite --rate")
    rate = rates[0]
    slo = SLO.parse(args.slo)
    prices = parse_prices(args.price)
    name, model = model_config_of(args.model)
    tables = _tables(args)
    candidates = []
    for gpu_key in [g.strip().lower() for g in args.gpus.split(",") if g.strip()]:
        if gpu_key not in prices:
            raise ValueError(f"no price for {gpu_key}; give one with --price {gpu_key}=DOLLARS")
        for tp in [int(t) for t in args.tp_options.split(",") if t.strip()]:
            if tp > args.gpus_per_host:
                continue
            try:
                _shard(model, tp)
            except ValueError:
                continue  # the model's heads do not split over this TP
            replica, _ = replica_config(args, model, gpu_key, tp, tables)
            longest = replica.max_model_len // replica.block_size + 1
            if replica.num_blocks < longest:
                out.write(f"  {gpu_key} TP{tp}: the model leaves no room for a full-length sequence\n")
                continue
            cost, note = cost_model_for(args, model, gpu_key, tp, tables, replica.async_scheduling)
            candidates.append(Candidate(gpu_key, tp, prices[gpu_key], cost, replica, note, args.gpus_per_host))
    if not candidates:
        raise ValueError("no GPU type and TP degree can hold the model")

    def workload(r: float, n: int, seed: int):
        return workload_for(args, r, n, seed)

    if args.trace:
        raise ValueError("--plan draws its own arrivals at each rate: give lengths by flags, not --trace")
    out.write(f"planning {name} at {rate:g} req/s, {slo}; {len(candidates)} candidates "
              f"({args.num_prompts} requests per probe, {args.dp_routing} router); prices: {PRICE_SOURCE}\n")
    with progress_bar(None, "planning", unit="probe") as bar:
        planner = Planner(slo, rate, workload, args.num_prompts, args.dp_routing, _ingress_s(args), _api_cost(args),
                          args.seed, out=out, verbose=args.verbose, progress=bar)
        results = planner.plan(candidates, args.top)
    if not results:
        out.write("no layout meets the SLO\n")
        return 1
    out.write(format_plan(results, rate, slo, args.top))
    return 0
