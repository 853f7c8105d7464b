"""`rooflm bench`: latency and throughput of the offline engine, and `serve` for an endpoint.

`rooflm.cli` imports this module when it exists and calls `register`.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO


def register(subparsers) -> None:
    """Add `bench` with its subcommands latency, throughput and serve."""
    # Imported here, not at module level: latency and throughput import torch, which
    # `rooflm --help` and the other commands' parsers need not load.
    from rooflm.bench import latency, serve, throughput

    bench = subparsers.add_parser(
        "bench", help="benchmarks: latency, throughput (offline engine), serve (an endpoint), train",
        description="Benchmarks. latency: one batch, TTFT/TPOT/MBU. throughput: many requests at "
                    "once, tokens/s against the analytic bound. serve: load-test an "
                    "OpenAI-compatible server. train: the training knob sweep (rooflm/train).")
    bench_subparsers = bench.add_subparsers(dest="bench_command", required=True)
    latency.register(bench_subparsers)
    throughput.register(bench_subparsers)
    # DP lives in rooflm/dp/offline.py, which reuses throughput's helpers: dispatching here
    # keeps bench.throughput -> dp.offline -> bench.throughput from being an import cycle.
    bench_subparsers.choices["throughput"].set_defaults(func=run_throughput_command)
    serve.register(bench_subparsers)
    from rooflm.train import bench as train_bench  # `rooflm bench train`: the training knob sweep
    train_bench.register(bench_subparsers)


def run_throughput_command(args: argparse.Namespace, out: TextIO = None) -> int:
    """`rooflm bench throughput`: one engine, or N data-parallel engines with -dp N."""
    from rooflm.bench.throughput import _check_args, run_throughput
    if args.data_parallel_size > 1:
        from rooflm.dp.offline import run_data_parallel
        _check_args(args)
        return run_data_parallel(args, out or sys.stdout)
    return run_throughput(args, out)
