"""bench serve's server-side TTFT: quantiles of a Prometheus histogram, as histogram_quantile."""

import math

import pytest

from rooflm.bench.server_side import run_ttft_ms
from rooflm.perf.serving_metrics import histogram_quantile

INF = math.inf


def test_quantile_is_linear_within_its_bucket():
    buckets = {0.01: 10.0, 0.02: 30.0, 0.04: 90.0, 0.08: 100.0, INF: 100.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.02 + 0.02 * (50 - 30) / 60)
    assert histogram_quantile(0.05, buckets) == pytest.approx(0.005)
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.04 + 0.04 * 9 / 10)


def test_the_inf_bucket_answers_the_largest_finite_bound():
    assert histogram_quantile(0.99, {0.1: 5.0, INF: 10.0}) == pytest.approx(0.1)
    assert histogram_quantile(0.5, {0.1: 0.0, INF: 0.0}) is None


def test_a_run_is_the_difference_of_two_scrapes():
    before = {0.02: 100.0, 0.04: 100.0, 0.08: 100.0, INF: 100.0}  # earlier requests, all fast
    after = {0.02: 100.0, 0.04: 150.0, 0.08: 200.0, INF: 200.0}
    run = run_ttft_ms(before, after)
    assert run["count"] == 100
    assert run["median"] == pytest.approx(40.0) and run["p99"] == pytest.approx(40 + 40 * 49 / 50)
    assert run_ttft_ms(None, after) is None and run_ttft_ms(before, before) is None


def test_the_pool_draws_the_single_client_schedule(monkeypatch):
    import asyncio
    import itertools

    from rooflm.bench import serve
    from rooflm.bench.client_pool import arrival_offsets

    gaps = []

    async def record(seconds):
        gaps.append(seconds)

    monkeypatch.setattr(serve.asyncio, "sleep", record)

    async def drain():
        async for _ in serve._arrivals(list(range(5)), 400.0, 1.0, 3):
            pass

    asyncio.run(drain())
    assert arrival_offsets(5, 400.0, 1.0, seed=3) == pytest.approx([0.0, *itertools.accumulate(gaps)])
    assert arrival_offsets(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]
