"""`rooflm bench`: latency and throughput of the offline engine, and `serve` for an endpoint.

`rooflm.cli` imports this module when it exists and calls `register`.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO


def register(subparsers):
    """Add `bench` with its subcommands latency, throughput and serve; return its subparsers, where
    the training lab adds `bench train` (rooflm/cli.py: the tools do not import each other)."""
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
    # DP lives in rooflm/bench/dp_offline.py, which reuses throughput's helpers: dispatching here
    # keeps bench.throughput -> bench.dp_offline -> bench.throughput from being an import cycle.
    bench_subparsers.choices["throughput"].set_defaults(func=run_throughput_command)
    serve.register(bench_subparsers)
    return bench_subparsers


def run_throughput_command(args: argparse.Namespace, out: TextIO = None) -> int:
    """`rooflm bench throughput`: one engine, or N data-parallel engines with -dp N."""
    from rooflm.bench.throughput import _check_args, run_throughput
    if args.data_parallel_size > 1:
        from rooflm.bench.dp_offline import run_data_parallel
        _check_args(args)
        return run_data_parallel(args, out or sys.stdout)
    return run_throughput(args, out)
