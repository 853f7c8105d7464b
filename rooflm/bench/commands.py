"""`rooflm bench`: latency and throughput of the offline engine, and `serve` for an endpoint.

`rooflm.cli` imports this module when it exists and calls `register`.
"""

from __future__ import annotations


def register(subparsers) -> None:
    """Add `bench` with its subcommands latency, throughput and serve."""
    # Imported here, not at module level: rooflm.cli imports this module while
    # it builds its parser, and latency/throughput import rooflm.cli back.
    from rooflm.bench import latency, serve, throughput

    bench = subparsers.add_parser(
        "bench", help="benchmarks: latency, throughput (offline engine), serve (an endpoint), train",
        description="Benchmarks. latency: one batch, TTFT/TPOT/MBU. throughput: many requests at "
                    "once, tokens/s against the analytic bound. serve: load-test an "
                    "OpenAI-compatible server. train: the training knob sweep (rooflm/train).")
    bench_subparsers = bench.add_subparsers(dest="bench_command", required=True)
    latency.register(bench_subparsers)
    throughput.register(bench_subparsers)
    serve.register(bench_subparsers)
    from rooflm.train import bench as train_bench  # `rooflm bench train`: the training knob sweep
    train_bench.register(bench_subparsers)
