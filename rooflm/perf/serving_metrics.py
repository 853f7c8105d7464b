"""Serving metrics of a run's requests: TTFT, TPOT, ITL, E2EL percentiles, throughput and goodput.

`rooflm bench serve` (rooflm/bench/serve.py) fills one RequestOutput per streamed request and the
simulator (rooflm/sim/metrics.py) one per simulated request; both report through these functions,
so a simulated run and a measured one print the same block (vLLM's benchmark_serving layout).
"""

from __future__ import annotations

import argparse
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Sequence


@dataclass
class RequestOutput:
    """What one streamed request measured. Times are seconds; `start` and `chunk_times` are
    relative to the start of the benchmark."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: Optional[float] = 0.0  # None: not measurable, every token came in one chunk
    chunks: int = 0  # chunks that carried output tokens
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    generated_text: str = ""


def parse_goodput(items: Optional[Sequence[str]]) -> dict[str, float]:
    """`ttft:500 tpot:50 e2el:2000` (milliseconds) -> {"ttft": 500.0, ...}."""
    slos: dict[str, float] = {}
    for item in items or []:
        for part in item.replace(",", " ").split():
            name, sep, value = part.partition(":")
            name = name.strip().lower()
            if not sep or name not in ("ttft", "tpot", "e2el"):
                raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {part!r}")
            slos[name] = float(value)
    return slos


def stats(values_ms: Sequence[float]) -> Optional[dict[str, float]]:
    """mean, median, P90, P99; None without samples (reported as n/a, not 0)."""
    import numpy as np

    if len(values_ms) == 0:
        return None
    arr = np.asarray(values_ms, dtype=np.float64)
    return {"mean": float(arr.mean()), "median": float(np.median(arr)),
            "p90": float(np.percentile(arr, 90)), "p99": float(np.percentile(arr, 99))}


def tpot_s(out: RequestOutput) -> Optional[float]:
    """None where it cannot be measured: one output token, or all tokens in one chunk (the
    gap between the first token and the others never reached the client)."""
    if out.output_tokens < 2 or out.chunks < 2 or out.ttft is None:
        return None
    return (out.latency - out.ttft) / (out.output_tokens - 1)


def why_not_measured(ok: Sequence[RequestOutput]) -> dict[str, str]:
    """For each figure with no sample at all, the reason, printed in place of its numbers."""
    if not ok:
        reason = "no request succeeded"
        return {k: reason for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms",
                                    "peak_output_throughput")}
    why = {}
    one_chunk = ("every request's tokens arrived in one chunk (the server streamed no "
                 "per-token chunks)")
    if all(o.ttft is None for o in ok):
        why["ttft_ms"] = one_chunk
    if all(o.output_tokens < 2 for o in ok):
        why["tpot_ms"] = why["itl_ms"] = "every request generated fewer than 2 tokens"
    elif all(o.chunks < 2 for o in ok):
        why["tpot_ms"] = why["itl_ms"] = one_chunk
        # Per-second buckets of one chunk per request show when requests ended, not when
        # tokens were made: no peak token rate.
        why["peak_output_throughput"] = one_chunk
    return why


def compute_metrics(outputs: Sequence[RequestOutput], duration: float,
                    goodput_slos: Optional[dict[str, float]] = None) -> dict:
    """The summary figures of a run; latencies in milliseconds, rates per second."""
    ok = [o for o in outputs if o.success]
    failed = [o for o in outputs if not o.success]
    ttfts = [o.ttft * 1e3 for o in ok if o.ttft is not None]
    tpots = [t * 1e3 for t in (tpot_s(o) for o in ok) if t is not None]
    itls = [gap * 1e3 for o in ok for gap in o.itl]
    e2els = [o.latency * 1e3 for o in ok]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_tokens for o in ok)

    not_measured = why_not_measured(ok)
    good = None
    if goodput_slos and not any(f"{k}_ms" in not_measured for k in goodput_slos):
        good = 0
        for o in ok:
            tpot = tpot_s(o)
            # A one-token request has no TPOT and meets any TPOT SLO (vLLM's rule); a TTFT
            # that was not measured meets none.
            if ("ttft" in goodput_slos and (o.ttft is None or o.ttft * 1e3 > goodput_slos["ttft"])) or \
               ("tpot" in goodput_slos and tpot is not None and tpot * 1e3 > goodput_slos["tpot"]) or \
               ("e2el" in goodput_slos and o.latency * 1e3 > goodput_slos["e2el"]):
                continue
            good += 1
    elif goodput_slos:
        not_measured["request_goodput"] = "an SLO'd figure was not measured: " + "; ".join(
            not_measured[f"{k}_ms"] for k in goodput_slos if f"{k}_ms" in not_measured)

    # Output tokens per one-second bucket, each chunk weighted by the tokens it carried
    # (usage may count more tokens than chunks when a server sends several per chunk).
    buckets: Counter = Counter()
    for o in ok:
        if o.chunk_times:
            weight = o.output_tokens / len(o.chunk_times)
            for t in o.chunk_times:
                buckets[int(t)] += weight
    # Peak in-flight requests: sweep the start/end events of every request.
    events = sorted([(o.start, 1) for o in outputs] + [(o.start + o.latency, -1) for o in outputs],
                    key=lambda e: (e[0], e[1]))
    in_flight = peak_in_flight = 0
    for _, delta in events:
        in_flight += delta
        peak_in_flight = max(peak_in_flight, in_flight)

    duration = max(duration, 1e-9)
    return {
        "completed": len(ok), "failed": len(failed), "duration": duration,
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": (good / duration) if good is not None else None,
        "good_requests": good,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "peak_output_throughput": (max(buckets.values()) if buckets
                                   and "peak_output_throughput" not in not_measured else None),
        "peak_concurrent_requests": peak_in_flight,
        "ttft_ms": stats(ttfts), "tpot_ms": stats(tpots), "itl_ms": stats(itls),
        "e2el_ms": stats(e2els),
        "errors": dict(Counter(o.error for o in failed).most_common()),
        "not_measured": not_measured,  # figure -> why it is n/a
    }


def format_report(metrics: dict, args: argparse.Namespace) -> str:
    width = 50

    def title(text: str, fill: str) -> str:
        return text.center(width, fill)

    def row(label: str, value, decimals: int = 2) -> str:
        text = f"{value:.{decimals}f}" if isinstance(value, float) else str(value)
        return f"{label:<40} {text:<10}"

    not_measured = metrics.get("not_measured", {})

    def na(label: str, key: str) -> str:
        return row(label, f"n/a ({not_measured.get(key, 'not measured')})")

    lines = [title(" Serving Benchmark Result ", "="),
             row("Successful requests:", metrics["completed"]),
             row("Failed requests:", metrics["failed"])]
    if args.max_concurrency:
        lines.append(row("Maximum request concurrency:", args.max_concurrency))
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    lines.append(row("Request rate configured (RPS):", rate))
    lines += [row("Benchmark duration (s):", metrics["duration"]),
              row("Total input tokens:", metrics["total_input_tokens"]),
              row("Total generated tokens:", metrics["total_output_tokens"]),
              row("Request throughput (req/s):", metrics["request_throughput"])]
    if metrics["request_goodput"] is not None:
        lines.append(row("Request goodput (req/s):", metrics["request_goodput"]))
    elif "request_goodput" in not_measured:
        lines.append(na("Request goodput (req/s):", "request_goodput"))
    peak = metrics["peak_output_throughput"]
    lines += [row("Output token throughput (tok/s):", metrics["output_throughput"]),
              row("Peak output token throughput (tok/s):", float(peak)) if peak is not None
              else na("Peak output token throughput (tok/s):", "peak_output_throughput"),
              row("Peak concurrent requests:", metrics["peak_concurrent_requests"]),
              row("Total token throughput (tok/s):", metrics["total_token_throughput"])]
    sections = (("ttft_ms", "TTFT", "Time to First Token"),
                ("tpot_ms", "TPOT", "Time per Output Token (excl. 1st token)"),
                ("itl_ms", "ITL", "Inter-token Latency"),
                ("e2el_ms", "E2EL", "End-to-end Latency"))
    for key, short, long in sections:
        stats = metrics[key]
        lines.append(title(long, "-"))
        if stats is None:
            lines.append(na(f"{short} (ms):", key))
            continue
        lines.append(row(f"Mean {short} (ms):", stats["mean"]))
        lines.append(row(f"Median {short} (ms):", stats["median"]))
        lines.append(row(f"P90 {short} (ms):", stats["p90"]))
        lines.append(row(f"P99 {short} (ms):", stats["p99"]))
    if metrics.get("server_ttft_ms"):
        server = metrics["server_ttft_ms"]
        lines.append(title("Server side (/metrics histogram)", "-"))
        lines.append(row("Median TTFT at the server (ms):", server["median"]))
        lines.append(row("P99 TTFT at the server (ms):", server["p99"]))
    if "client_cpu_busy" in metrics:
        label = "Client CPU busy (% of the run):" if metrics.get("client_processes", 1) == 1 \
            else f"Client CPU busy (busiest of {metrics['client_processes']}, %):"
        lines.append(row(label, 100 * metrics["client_cpu_busy"], 1))
    lines.append("=" * width)
    if metrics["errors"]:
        lines.append(f"Errors ({metrics['failed']} failed requests):")
        for message, count in list(metrics["errors"].items())[:10]:
            lines.append(f"  {count:>5} x {message}")
        if len(metrics["errors"]) > 10:
            lines.append(f"  ... and {len(metrics['errors']) - 10} other messages")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the command


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def format_sweep(rates: Sequence[float], sweep: Sequence[dict]) -> str:
    """One line per rate: the figures users compare across load, n/a where not measured."""
    def ms(stats: Optional[dict], key: str) -> str:
        return "n/a" if stats is None else f"{stats[key]:.1f}"

    lines = [f"{'rate':>6} {'ok':>5} {'fail':>5} {'req/s':>7} {'good/s':>7} {'tok/s':>8} "
             f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9}"]
    for rate, m in zip(rates, sweep):
        good = "n/a" if m["request_goodput"] is None else f"{m['request_goodput']:.2f}"
        lines.append(f"{rate_label(rate):>6} {m['completed']:>5} {m['failed']:>5} "
                     f"{m['request_throughput']:>7.2f} {good:>7} {m['output_throughput']:>8.1f} "
                     f"{ms(m['ttft_ms'], 'median'):>9} {ms(m['ttft_ms'], 'p99'):>9} "
                     f"{ms(m['tpot_ms'], 'median'):>9} {ms(m['tpot_ms'], 'p99'):>9}")
    return "\n".join(lines) + "\n"


def histogram_quantile(q: float, buckets: dict[float, float]) -> Optional[float]:
    """The q-quantile of a cumulative histogram {upper bound: count}, linear within the bucket
    it falls in (Prometheus' rule; the +Inf bucket answers with the largest finite bound)."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            width = count - below
            return le if width <= 0 else lower + (le - lower) * (rank - below) / width
        lower, below = le, count
    return lower
