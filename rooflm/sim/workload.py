"""What the simulator serves: a list of requests, each with its arrival time and lengths.

A workload is built from flags (an arrival process and length distributions), read from a
trace (JSON or CSV rows of arrival_s, prompt_len, output_len), or replayed from a
`rooflm bench serve` result file (each request's send time, prompt length and output
tokens), so that a measured run can be simulated on exactly the traffic it saw.

Arrival processes, with mean rate `rate` requests per second:
  poisson   exponential gaps;
  gamma     gamma gaps of shape `burstiness` (below 1 burstier than Poisson), the
            process `bench serve --burstiness` uses (and with its random draws: the same
            seed gives the same send schedule);
  burst     groups of `burst_size` requests arriving together, groups Poisson at rate / size;
  offline   everything at t = 0 (`bench throughput`, `bench serve --request-rate inf`).
Length distributions for prompts and outputs:
  fixed     every request the mean;
  uniform   uniform in [mean (1 - r), mean (1 + r)] (`bench serve --range-ratio r`);
  lognormal a ShareGPT-like long tail: lognormal with the given mean and sigma, clipped as
            bench serve clips ShareGPT (prompt <= 1024, prompt + output <= 2048).
Shared-prefix groups: `num_prefixes` prompts prefixes of `prefix_len` tokens, request i using
prefix i mod num_prefixes, so the engine's prefix cache sees the hits it would see.
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass
from typing import Optional

ARRIVALS = ("poisson", "gamma", "burst", "offline")
LENGTHS = ("fixed", "uniform", "lognormal")


@dataclass(frozen=True)
class SimRequest:
    """One request of a workload. output_len tokens are generated; max_tokens (default
    output_len) is what the request asks for, so a request that stops early (EOS) is a
    request with output_len < max_tokens."""

    arrival_s: float
    prompt_len: int
    output_len: int
    max_tokens: Optional[int] = None
    prefix_group: Optional[int] = None  # shares its first prefix_len tokens with its group
    prefix_len: int = 0
    priority: int = 0  # --scheduling-policy priority: lower first

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError(f"a request needs prompt_len >= 1 and output_len >= 1, got "
                             f"{self.prompt_len} and {self.output_len}")
        if self.max_tokens is not None and self.max_tokens < self.output_len:
            raise ValueError(f"max_tokens {self.max_tokens} < output_len {self.output_len}")
        if self.prefix_len > self.prompt_len:
            raise ValueError(f"prefix_len {self.prefix_len} > prompt_len {self.prompt_len}")

    @property
    def stops_early(self) -> bool:
        return self.max_tokens is not None and self.max_tokens > self.output_len


@dataclass(frozen=True)
class LengthDist:
    kind: str = "fixed"
    mean: int = 256
    range_ratio: float = 0.0  # uniform
    sigma: float = 1.0  # lognormal: sigma of the underlying normal

    def __post_init__(self) -> None:
        if self.kind not in LENGTHS:
            raise ValueError(f"length distribution must be one of {', '.join(LENGTHS)}, got {self.kind!r}")
        if self.mean < 1:
            raise ValueError(f"mean length must be >= 1, got {self.mean}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range ratio must be in [0, 1), got {self.range_ratio}")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.mean
        if self.kind == "uniform":  # bench serve's _sample_len
            low = max(1, math.floor(self.mean * (1 - self.range_ratio)))
            high = max(low, math.ceil(self.mean * (1 + self.range_ratio)))
            return rng.randint(low, high)
        # lognormal with mean `mean`: mu = ln(mean) - sigma^2 / 2
        mu = math.log(self.mean) - self.sigma ** 2 / 2
        return max(1, round(rng.lognormvariate(mu, self.sigma)))


def arrival_times(n: int, process: str, rate: float, burstiness: float = 1.0, burst_size: int = 10,
                  seed: int = 0) -> list[float]:
    """n arrival times (seconds from 0), the first at 0 as `bench serve` sends its first."""
    if process not in ARRIVALS:
        raise ValueError(f"arrival process must be one of {', '.join(ARRIVALS)}, got {process!r}")
    if process == "offline" or math.isinf(rate):
        return [0.0] * n
    if not rate > 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    rng = random.Random(seed)
    times, t = [], 0.0
    if process == "burst":
        if burst_size < 1:
            raise ValueError(f"burst size must be >= 1, got {burst_size}")
        while len(times) < n:
            times.extend([t] * min(burst_size, n - len(times)))
            t += rng.expovariate(rate / burst_size)
        return times
    shape = 1.0 if process == "poisson" else burstiness
    if shape <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    for i in range(n):
        times.append(t)
        if i < n - 1:  # bench serve's _arrivals: one gamma draw between consecutive sends
            t += rng.gammavariate(shape, 1.0 / (rate * shape))
    return times


def synthetic_workload(n: int, prompt: LengthDist, output: LengthDist, process: str = "poisson",
                       rate: float = math.inf, burstiness: float = 1.0, burst_size: int = 10,
                       num_prefixes: int = 0, prefix_len: int = 0, seed: int = 0) -> list[SimRequest]:
    """Requests from distributions; with shared prefixes the prompt length drawn is the
    unique suffix after the prefix (as `bench serve --dataset-name prefix` counts it)."""
    if n < 1:
        raise ValueError(f"number of requests must be >= 1, got {n}")
    if num_prefixes < 0 or prefix_len < 0 or (num_prefixes > 0) != (prefix_len > 0):
        raise ValueError("shared prefixes need both num_prefixes >= 1 and prefix_len >= 1")
    rng = random.Random(seed)
    lengths = []
    for _ in range(n):
        p = prompt.sample(rng)
        o = output.sample(rng)
        if prompt.kind == "lognormal" or output.kind == "lognormal":
            p = min(p, 1024)  # bench serve's ShareGPT filter, applied as a clip
            o = max(1, min(o, 2048 - p))
        lengths.append((p, o))
    times = arrival_times(n, process, rate, burstiness, burst_size, seed)
    requests = []
    for i, ((p, o), t) in enumerate(zip(lengths, times)):
        if num_prefixes:
            requests.append(SimRequest(t, prefix_len + p, o, prefix_group=i % num_prefixes,
                                       prefix_len=prefix_len))
        else:
            requests.append(SimRequest(t, p, o))
    return requests


# ---------------------------------------------------------------- traces


def _row_request(row: dict, where: str) -> SimRequest:
    def num(key, cast, default=None):
        value = row.get(key, default)
        if value in (None, ""):
            if default is None:
                raise ValueError(f"{where}: missing {key!r}")
            return default
        try:
            return cast(value)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: {key} must be a number, got {value!r}") from None

    group = row.get("prefix_group")
    return SimRequest(
        arrival_s=num("arrival_s", float), prompt_len=num("prompt_len", int),
        output_len=num("output_len", int),
        max_tokens=num("max_tokens", int, 0) or None,
        prefix_group=None if group in (None, "") else int(group),
        prefix_len=num("prefix_len", int, 0))


def load_trace(path: str) -> list[SimRequest]:
    """A trace file: CSV with a header, or JSON (a list of objects, or {"requests": [...]}),
    with arrival_s, prompt_len, output_len and optionally max_tokens, prefix_group,
    prefix_len. A `rooflm bench serve` result file is recognised and replayed."""
    if path.endswith(".csv"):
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
        requests = [_row_request(r, f"{path} row {i + 2}") for i, r in enumerate(rows)]
    else:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if isinstance(data, dict) and "requests" in data and "ttft_ms" in data:
            return from_bench_serve(data, path)
        rows = data["requests"] if isinstance(data, dict) else data
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a list of requests")
        requests = [_row_request(r, f"{path} request {i}") for i, r in enumerate(rows)]
    if not requests:
        raise ValueError(f"{path}: no requests")
    return sorted(requests, key=lambda r: r.arrival_s)


def from_bench_serve(result: dict, where: str = "bench serve result") -> list[SimRequest]:
    """The traffic a `bench serve` run sent: each successful request at its send time, with
    the prompt length and output tokens the server's usage chunk reported. Failed requests
    are left out (their lengths are unknown)."""
    rows = result.get("requests") or []
    requests = []
    for r in rows:
        if r.get("success") and r.get("output_tokens", 0) >= 1 and r.get("prompt_len", 0) >= 1:
            requests.append(SimRequest(float(r["start"]), int(r["prompt_len"]), int(r["output_tokens"])))
    if not requests:
        raise ValueError(f"{where}: no successful requests with lengths to replay")
    return sorted(requests, key=lambda r: r.arrival_s)

