"""What the server measured while `rooflm bench serve` ran: its own time to first token.

A benchmark client times a request from its send to the first streamed chunk it parsed, so its
TTFT also holds the network, the SSE write and the client's own event loop, which at thousands
of chunks a second in one Python process can be busy enough to delay reading (vLLM's benchmark
has the same shape). The server's `vllm:time_to_first_token_seconds` histogram (rooflm and
vLLM both export it) times arrival at the API process to the first token there. Scraping
/metrics before and after a run and taking the difference gives the run's own histogram; its
quantiles come out as Prometheus' histogram_quantile computes them (linear within a bucket), so
they are only as fine as the buckets (vLLM's: 20 ms wide between 20 and 100 ms).
"""

from __future__ import annotations

import math
import urllib.request
from typing import Optional

from rooflm.perf.serving_metrics import histogram_quantile

TTFT_BUCKETS = "vllm:time_to_first_token_seconds_bucket"


def scrape_ttft_buckets(base_url: str, timeout: float = 5.0) -> Optional[dict[float, float]]:
    """Cumulative counts per upper bound (seconds) of the server's TTFT histogram, summed over
    its label sets; None when the server has no /metrics or no such histogram."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout) as resp:
            text = resp.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return None
    counts: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == TTFT_BUCKETS:
                le = float(sample.labels["le"])
                counts[le] = counts.get(le, 0.0) + sample.value
    return counts or None


def run_ttft_ms(before: Optional[dict[float, float]], after: Optional[dict[float, float]]) -> Optional[dict]:
    """Median and P99 TTFT (ms) of the requests between two scrapes, with their count."""
    if before is None or after is None:
        return None
    delta = {le: after[le] - before.get(le, 0.0) for le in after}
    count = delta.get(math.inf, max(delta.values(), default=0.0))
    if count <= 0:
        return None
    return {"median": histogram_quantile(0.5, delta) * 1e3, "p99": histogram_quantile(0.99, delta) * 1e3,
            "count": int(count)}
