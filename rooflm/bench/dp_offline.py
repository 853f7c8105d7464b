"""`rooflm bench throughput --data-parallel-size N`: N engines over shares of the prompts.

Each replica is a process of its own (multiprocessing 'spawn') on its own GPU or
TP group (dp/replicas.replica_gpus), as a vLLM offline data-parallel run is:
it builds its engine, draws the same request list (same seed) and keeps every
N-th request (r, r+N, ...), warms up, then waits at a barrier so that all
replicas start the clock together. The run's time is the first start to the
last finish (time.monotonic is one clock for the whole host); the tokens are
the replicas' sums. With a GPU, each replica prices its share (throughput_bound)
and the run's bound is the total output over the slowest share's floor.

No router here: the offline workload has no prefix to share (random ids) and
all requests are known up front, so an even static split is the best one.
"""

from __future__ import annotations

import argparse
import multiprocessing
import queue
import sys
import time
from typing import Optional, TextIO

from rooflm.engine_args import engine_kwargs

# How long a replica may take to build its engine and warm up before the run gives up.
START_TIMEOUT_S = 1800.0


def run_data_parallel(args: argparse.Namespace, out: Optional[TextIO] = None) -> int:
    from rooflm.bench.throughput import format_summary
    from rooflm.perf.results import write_json
    from rooflm.config import engine_config_from_kwargs
    from rooflm.dp.replicas import replica_gpus

    out = out or sys.stdout
    size = args.data_parallel_size
    engine_options = engine_kwargs(args)
    gpus = replica_gpus(engine_config_from_kwargs(**engine_options), size)
    spawn = multiprocessing.get_context("spawn")
    barrier = spawn.Barrier(size)
    results = spawn.Queue()
    plain = {k: v for k, v in vars(args).items() if k != "func"}
    processes = []
    for r in range(size):
        env = {} if gpus is None else {"CUDA_VISIBLE_DEVICES": gpus[r]}
        process = spawn.Process(target=_replica_main, name=f"rooflm-dp-bench-{r}",
                                args=(r, size, plain, env, barrier, results))
        process.start()
        processes.append(process)
    try:
        replicas = _collect(processes, results, size)
    finally:
        for process in processes:
            process.join(5.0)
            if process.is_alive():
                process.kill()
                process.join(5.0)
    result = merge_results(replicas, engine_options, args)
    out.write(format_summary(result, result["device_type"]))
    if args.output_json:
        write_json(args.output_json, result)
        out.write(f"result written to {args.output_json}\n")
    return 0


def _collect(processes, results, size: int) -> list[dict]:
    """Every replica's result, in replica order. Raises RuntimeError naming a replica that
    failed or exited without one (the others are killed by the caller)."""
    found: dict[int, dict] = {}
    deadline = time.monotonic() + START_TIMEOUT_S
    while len(found) < size:
        try:
            r, payload = results.get(timeout=1.0)
        except queue.Empty:
            for r, process in enumerate(processes):
                if r not in found and not process.is_alive():
                    raise RuntimeError(f"data-parallel replica {r} exited with code "
                                       f"{process.exitcode} before it reported") from None
            if time.monotonic() > deadline:
                raise RuntimeError("the data-parallel replicas did not finish in time") from None
            continue
        if "error" in payload:
            raise RuntimeError(f"data-parallel replica {r} failed: "
                               f"{_root_cause(r, payload['error'], results)}")
        found[r] = payload
    return [found[r] for r in range(size)]


def _root_cause(rank: int, error: str, results) -> str:
    """A replica that failed breaks the barrier the others wait at: report its error, not
    theirs (BrokenBarrierError), if it arrives within a few seconds."""
    deadline = time.monotonic() + 5.0
    while error.startswith("BrokenBarrierError") and time.monotonic() < deadline:
        try:
            other, payload = results.get(timeout=0.5)
        except queue.Empty:
            continue
        if "error" in payload and not payload["error"].startswith("BrokenBarrierError"):
            return f"(replica {other}) {payload['error']}"
    return error


def _replica_main(rank: int, size: int, plain: dict, env: dict, barrier, results) -> None:
    import os
    os.environ.update(env)  # before CUDA starts: this replica's GPUs
    try:
        results.put((rank, _run_share(rank, size, argparse.Namespace(**plain), barrier)))
    except BaseException as exc:  # noqa: BLE001 - the parent names the replica and the error
        barrier.abort()  # the others stop waiting
        results.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))


def _run_share(rank: int, size: int, args: argparse.Namespace, barrier) -> dict:
    import os

    import torch

    from rooflm.bench.throughput import (_check_args, prepare_run, run_requests,
                                         throughput_bound, warmup_requests)
    from rooflm.engine.llm_engine import LLMEngine

    _check_args(args)
    if "CUDA_VISIBLE_DEVICES" not in os.environ or args.device == "cpu":
        # Replicas on the CPU share its cores: threads beyond a replica's share only wait.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    engine = LLMEngine.from_kwargs(**engine_kwargs(args))
    try:
        device, gpu, stamp_fields, everything = prepare_run(args, engine)
        share = everything[rank::size]
        if args.num_warmup_requests:
            run_requests(engine, warmup_requests(share, args.num_warmup_requests), "warm-up",
                         disable_tqdm=True)
        barrier.wait(timeout=START_TIMEOUT_S)
        started = time.monotonic()
        run = run_requests(engine, share, f"replica-{rank}", disable_tqdm=True)
        finished = time.monotonic()
        bound = throughput_bound(engine, gpu, share) if gpu is not None and share else None
        return {"replica": rank, "started": started, "finished": finished,
                "elapsed_s": run.elapsed_s, "num_requests": len(share),
                "num_completed": run.num_completed, "prompt_tokens": run.prompt_tokens,
                "output_tokens": run.output_tokens,
                "expected_output_tokens": sum(r.output_len for r in share),
                "cached_prompt_tokens": run.cached_prompt_tokens, "steps": run.steps,
                "preemptions": run.preemptions, "stamp": stamp_fields,
                "dtype": engine.info.dtype, "kv_cache_blocks": engine.info.num_blocks,
                "block_size": engine.info.block_size, "startup_s": engine.info.startup_s,
                "device_type": device.type,
                "bound": bound}
    finally:
        engine.shutdown()


def merge_results(replicas: list[dict], engine_options: dict, args: argparse.Namespace) -> dict:
    """One throughput result (bench/throughput.py's shape) for the replicas together."""
    elapsed = max(r["finished"] for r in replicas) - min(r["started"] for r in replicas)
    completed = sum(r["num_completed"] for r in replicas)
    prompt = sum(r["prompt_tokens"] for r in replicas)
    output = sum(r["output_tokens"] for r in replicas)
    expected = sum(r["expected_output_tokens"] for r in replicas)
    if output != expected:
        print(f"warning: generated {output} output tokens, asked for {expected}", file=sys.stderr)
    first = replicas[0]
    result = {
        "benchmark": "throughput", **first["stamp"], "device_type": first["device_type"],
        "model": args.model or "default (SmolLM2-135M-Instruct)", "dtype": first["dtype"],
        "dataset": args.dataset or "random",
        "num_prompts": sum(r["num_requests"] for r in replicas), "input_len": args.input_len,
        "output_len": args.output_len, "range_ratio": args.range_ratio,
        "engine_options": engine_options, "data_parallel_size": len(replicas),
        "startup_s": max(r["startup_s"] for r in replicas),
        "kv_cache_blocks": first["kv_cache_blocks"], "block_size": first["block_size"],
        "elapsed_s": elapsed, "num_completed": completed,
        "total_prompt_tokens": prompt, "total_output_tokens": output,
        "expected_output_tokens": expected,
        "requests_per_s": completed / elapsed, "output_tokens_per_s": output / elapsed,
        "total_tokens_per_s": (prompt + output) / elapsed,
        "num_steps": sum(r["steps"] for r in replicas),
        "num_preemptions": sum(r["preemptions"] for r in replicas),
        "prefix_cache_hit_tokens": sum(r["cached_prompt_tokens"] for r in replicas),
        "bound": None, "fraction_of_bound": None, "breakdown": None, "spec_decode": None,
        "replicas": [{k: v for k, v in r.items() if k != "stamp"} for r in replicas],
    }
    bounds = [r["bound"] for r in replicas if r["bound"] is not None]
    if len(bounds) == len(replicas):
        # The replicas run side by side: the run ends when the slowest share's floor does.
        floor_s = max(b["floor_s"] for b in bounds)
        serial_s = max(b["serial_floor_s"] for b in bounds)
        result["bound"] = {**bounds[0], "floor_s": floor_s, "serial_floor_s": serial_s,
                           "output_tokens_per_s": expected / floor_s,
                           "serial_output_tokens_per_s": expected / serial_s,
                           "per_replica": True}
        result["fraction_of_bound"] = result["output_tokens_per_s"] / (expected / floor_s)
    return result
