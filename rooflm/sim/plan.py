"""`rooflm simulate --plan`: the cheapest layouts that serve a rate within an SLO.

A layout is a GPU type, a tensor-parallel degree TP (one engine over TP GPUs of one host)
and a number DP of data-parallel replicas behind a router; it needs TP x DP GPUs on
ceil(DP / (gpus_per_host / TP)) hosts. For each GPU type and TP that holds the model:

  1. capacity: one replica serves a batch of requests all at once; its throughput X bounds
     what it can take, so at least ceil(rate / X) replicas are needed;
  2. the fewest replicas that meet the SLO: one replica under Poisson arrivals at
     rate / DP (a replica's share; a load-aware router gives it smoother arrivals than
     that, so this errs on the safe side), from that bound upward, doubling the step
     until the SLO holds, then bisecting;
  3. headroom: the highest rate per replica that still meets the SLO (bisection, at most its
     capacity), as a share above the rate asked for; and the margin of each SLO figure;
  4. the cheapest layouts are checked once more as a whole: DP replicas behind the
     router, at the full rate (one more replica is added while that check fails).
The price of a layout is its GPUs x the price per GPU-hour (prices.py).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, TextIO

from rooflm.sim.api_process import ApiCost
from rooflm.sim.cost_model import StepCostModel
from rooflm.sim.metrics import sim_metrics
from rooflm.sim.replica import ReplicaConfig
from rooflm.sim.simulator import SimConfig, simulate
from rooflm.sim.workload import SimRequest

_STATS = {"mean": "mean", "p50": "median", "median": "median", "p90": "p90", "p99": "p99"}
_FIGURES = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class SLO:
    """Limits in milliseconds on bench serve's figures: (figure, statistic) -> ms."""

    limits: tuple[tuple[str, str, float], ...]

    @classmethod
    def parse(cls, text: str) -> "SLO":
        """'ttft_p99=500ms,tpot_p50=30ms' (units ms or s; no unit: ms)."""
        limits = []
        for part in text.replace(" ", "").split(","):
            if not part:
                continue
            name, sep, value = part.partition("=")
            figure, _, stat = name.lower().partition("_")
            if not sep or figure not in _FIGURES or stat not in _STATS:
                raise ValueError(f"SLO terms look like ttft_p99=500ms (figures {', '.join(_FIGURES)}; "
                                 f"statistics {', '.join(_STATS)}), got {part!r}")
            scale = 1.0
            if value.endswith("ms"):
                value = value[:-2]
            elif value.endswith("s"):
                value, scale = value[:-1], 1e3
            try:
                ms = float(value) * scale
            except ValueError:
                raise ValueError(f"SLO value must be a number of ms or s, got {part!r}") from None
            if ms <= 0:
                raise ValueError(f"SLO limit must be > 0, got {part!r}")
            limits.append((figure, stat, ms))
        if not limits:
            raise ValueError("give at least one SLO term, e.g. ttft_p99=500ms")
        return cls(tuple(limits))

    def margins(self, metrics: dict) -> dict[str, float]:
        """Per term, 1 - value / limit: > 0 met with that share to spare, < 0 missed. A figure
        the run could not measure (no request finished) is -inf."""
        out = {}
        for figure, stat, limit in self.limits:
            stats = metrics.get(f"{figure}_ms")
            value = stats[_STATS[stat]] if stats else math.inf
            out[f"{figure}_{stat}"] = 1.0 - value / limit
        return out

    def met(self, metrics: dict) -> bool:
        return metrics["failed"] == 0 and all(m >= 0 for m in self.margins(metrics).values())

    def goodput_slos(self) -> dict[str, float]:
        """bench serve's per-request goodput SLOs: each figure's tightest limit."""
        out: dict[str, float] = {}
        for figure, _, limit in self.limits:
            if figure in ("ttft", "tpot", "e2el"):
                out[figure] = min(limit, out.get(figure, math.inf))
        return out

    def __str__(self) -> str:
        return ", ".join(f"{f}_{s} <= {v:g} ms" for f, s, v in self.limits)


@dataclass(frozen=True)
class Candidate:
    """One engine configuration to replicate: a GPU type at a TP degree."""

    gpu: str
    tp: int
    price_per_gpu_hour: float
    cost_model: StepCostModel
    replica: ReplicaConfig
    note: str = ""  # where the cost model's correction is from
    gpus_per_host: int = 8


@dataclass
class LayoutResult:
    candidate: Candidate
    dp: int
    metrics: dict  # one replica at rate / dp
    margins: dict[str, float]
    capacity_per_replica: float = math.inf  # requests/s of one replica given a backlog
    max_rate_per_replica: Optional[float] = None
    verified: Optional[bool] = None  # the whole layout at the full rate
    verified_metrics: Optional[dict] = field(default=None, repr=False)

    @property
    def num_gpus(self) -> int:
        return self.candidate.tp * self.dp

    @property
    def num_hosts(self) -> int:
        per_host = max(1, self.candidate.gpus_per_host // self.candidate.tp)
        return math.ceil(self.dp / per_host)

    @property
    def price_per_hour(self) -> float:
        return self.num_gpus * self.candidate.price_per_gpu_hour

    def headroom(self, rate: float) -> Optional[float]:
        if self.max_rate_per_replica is None:
            return None
        return self.max_rate_per_replica * self.dp / rate - 1.0


WorkloadFn = Callable[[float, int, int], list[SimRequest]]  # (rate, num requests, seed) -> requests


@dataclass
class Planner:
    slo: SLO
    rate: float
    workload: WorkloadFn
    num_prompts: int = 1000
    router: str = "least_loaded"
    ingress_s: float = 0.0
    api: ApiCost = ApiCost()
    seed: int = 0
    max_dp: int = 256
    out: TextIO = field(default_factory=lambda: sys.stdout)
    verbose: bool = False
    progress: Optional[Any] = None  # a tqdm bar: one tick a probe, the probe in its postfix

    def _run(self, cand: Candidate, rate: float, n: int, dp: int = 1) -> dict:
        cfg = SimConfig(cand.replica, num_replicas=dp, router=self.router, ingress_s=self.ingress_s, api=self.api,
                        seed=self.seed, record_steps=False)
        if self.progress is not None:
            self.progress.set_postfix_str(f"{cand.gpu} TP{cand.tp} DP{dp} at {rate:g} req/s, {n} requests")
        metrics = sim_metrics(simulate(cfg, cand.cost_model, self.workload(rate, n, self.seed)),
                              self.slo.goodput_slos(), series_points=0)
        if self.progress is not None:
            self.progress.update(1)
        return metrics

    def capacity(self, cand: Candidate) -> float:
        """Requests per second of one replica given a backlog (all at once)."""
        n = min(self.num_prompts, 4 * cand.replica.scheduler.max_num_seqs)
        metrics = self._run(cand, math.inf, n)
        return metrics["request_throughput"] if metrics["completed"] else 0.0

    def _meets(self, cand: Candidate, dp: int) -> tuple[bool, dict]:
        metrics = self._run(cand, self.rate / dp, self.num_prompts)
        ok = self.slo.met(metrics)
        if self.verbose:
            self.out.write(f"  {cand.gpu} TP{cand.tp} DP{dp}: {'meets' if ok else 'misses'} "
                           f"{self.slo} ({_short(metrics)})\n")
        return ok, metrics

    def fewest_replicas(self, cand: Candidate) -> Optional[LayoutResult]:
        cap = self.capacity(cand)
        if cap <= 0:
            return None
        low = max(1, math.ceil(self.rate / cap))  # fewer cannot keep up
        ok, metrics = self._meets(cand, low)
        if ok:
            return LayoutResult(cand, low, metrics, self.slo.margins(metrics), capacity_per_replica=cap)
        failed, step = low, 1
        while True:  # double the step until the SLO holds
            dp = failed + step
            if dp > self.max_dp:
                return None
            ok, metrics = self._meets(cand, dp)
            if ok:
                break
            failed, step = dp, step * 2
        best, best_metrics = dp, metrics
        while best - failed > 1:  # bisect (failed, best]
            mid = (failed + best) // 2
            ok, metrics = self._meets(cand, mid)
            if ok:
                best, best_metrics = mid, metrics
            else:
                failed = mid
        return LayoutResult(cand, best, best_metrics, self.slo.margins(best_metrics), capacity_per_replica=cap)

    def max_rate(self, cand: Candidate, low: float, capacity: float, steps: int = 6) -> float:
        """The highest rate one replica takes within the SLO, from a rate known to meet it, and
        never above its capacity (a short probe can meet an SLO at a rate no replica sustains)."""
        if low >= capacity:
            return capacity
        high = min(low * 2, capacity)
        while high < capacity and self.slo.met(self._run(cand, high, self.num_prompts)):
            low, high = high, min(high * 2, capacity)
        if high >= capacity and self.slo.met(self._run(cand, capacity, self.num_prompts)):
            return capacity
        for _ in range(steps):
            mid = (low + high) / 2
            if self.slo.met(self._run(cand, mid, self.num_prompts)):
                low = mid
            else:
                high = mid
        return low

    def verify(self, result: LayoutResult, extra: int = 4) -> LayoutResult:
        """The whole layout, DP replicas behind the router at the full rate; one replica more
        while it misses (up to `extra`)."""
        for dp in range(result.dp, result.dp + extra + 1):
            n = min(10_000, self.num_prompts * dp)
            metrics = self._run(result.candidate, self.rate, n, dp)
            if self.slo.met(metrics):
                if dp != result.dp:
                    result = replace(result, dp=dp, margins=self.slo.margins(metrics))
                result.verified, result.verified_metrics = True, metrics
                return result
        result.verified = False
        return result

    def plan(self, candidates: list[Candidate], top: int = 3) -> list[LayoutResult]:
        results = []
        for cand in candidates:
            found = self.fewest_replicas(cand)
            if found is None:
                self.out.write(f"  {cand.gpu} TP{cand.tp}: no layout up to DP {self.max_dp} meets the SLO\n")
                continue
            results.append(found)
        results.sort(key=lambda r: (r.price_per_hour, r.num_gpus))
        shortlisted = []
        for result in results[:top]:
            result = self.verify(result)
            result.max_rate_per_replica = self.max_rate(result.candidate, self.rate / result.dp,
                                                        result.capacity_per_replica)
            shortlisted.append(result)
        shortlisted.sort(key=lambda r: (not r.verified, r.price_per_hour, r.num_gpus))
        return shortlisted + results[top:]


def _short(metrics: dict) -> str:
    def fig(key, stat):
        s = metrics.get(key)
        return f"{s[stat]:.0f}" if s else "n/a"

    return (f"{metrics['request_throughput']:.1f} req/s, TTFT p50/p99 {fig('ttft_ms', 'median')}/"
            f"{fig('ttft_ms', 'p99')} ms, TPOT p50/p99 {fig('tpot_ms', 'median')}/{fig('tpot_ms', 'p99')} ms")


def format_plan(results: list[LayoutResult], rate: float, slo: SLO, top: int) -> str:
    lines = [f"Layouts for {rate:g} req/s with {slo}, cheapest first:",
             f"{'GPU':<6}{'TP':>3}{'DP':>5}{'GPUs':>6}{'hosts':>6}{'$/hour':>9}{'headroom':>10}"
             f"{'verified':>10}   SLO margins (share of each limit to spare)"]
    for r in results[:top]:
        head = r.headroom(rate)
        margins = ", ".join(f"{k} {v:+.0%}" for k, v in r.margins.items())
        verified = {True: "yes", False: "NO", None: "-"}[r.verified]
        lines.append(f"{r.candidate.gpu:<6}{r.candidate.tp:>3}{r.dp:>5}{r.num_gpus:>6}{r.num_hosts:>6}"
                     f"{r.price_per_hour:>9.2f}{('-' if head is None else f'{head:+.0%}'):>10}{verified:>10}"
                     f"   {margins}")
    lines.append("headroom: how much more traffic the layout takes within the SLO (one replica's highest "
                 "rate x DP over the rate asked for); verified: the whole layout simulated at the full "
                 "rate behind the router")
    notes = sorted({f"{r.candidate.gpu}: {r.candidate.note}" for r in results[:top] if r.candidate.note})
    lines += [f"cost model {n}" for n in notes]
    return "\n".join(lines) + "\n"
