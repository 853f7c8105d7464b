"""The discrete-event loop: arrivals, a router, and data-parallel replicas that step.

Events, in time order (a delivery before a step call at the same instant):
  arrival    the client sends a request; the router picks its replica at once;
  delivery   once the replica's API process has admitted it (sim/api_process.py: a FIFO
             server that also streams every token, so it queues under load) and `ingress_s`
             of latency later (HTTP, the hop to the engine core), the request is in that
             replica's scheduler;
  step call  a replica runs one LLMEngine.step() (replica.step_call) and says when the host
             is free for the next; an idle replica sleeps until its next delivery.
Each replica keeps its own clock through its step calls; they share nothing but the router.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

# The server's own router, so a simulated data-parallel layout makes the choices the real one
# would. The simulator names a prompt's prefix with one key (its prefix group, or its first
# block's tokens) where the server hashes every block: one key is a one-block chain.
from rooflm.dp.router import Router
from rooflm.sim.api_process import API_TOKEN_S, ApiCost, ApiProcess
from rooflm.sim.cost_model import StepCostModel
from rooflm.sim.replica import ReplicaConfig, RequestRecord, SimReplica
from rooflm.sim.workload import SimRequest

# The API path's latency beside its CPU work (sim/api_process.py): a request at concurrency 1
# had TTFT 10.63 ms through `rooflm serve` and 8.43 ms offline (H100,
# benchmarks/results/serving-h100-20261123-s4/README.md), 2.2 ms apart, of which the API
# process's CPU for the first token is counted by its own model.
SERVER_INGRESS_S = 0.0022 - API_TOKEN_S

_DELIVER, _WAKE = 0, 1


@dataclass(frozen=True)
class SimConfig:
    replica: ReplicaConfig
    num_replicas: int = 1
    router: str = "round_robin"
    ingress_s: float = SERVER_INGRESS_S
    vocab_size: int = 32000
    seed: int = 0
    record_steps: bool = True
    api: ApiCost = ApiCost()  # each replica's API process; all zero: no API process modelled

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"number of replicas must be >= 1, got {self.num_replicas}")
        if self.ingress_s < 0:
            raise ValueError(f"ingress must be >= 0 s, got {self.ingress_s}")


@dataclass
class SimResult:
    records: list[RequestRecord]  # in arrival order
    replicas: list[SimReplica] = field(repr=False)
    duration_s: float
    wall_s: float = 0.0  # how long the simulation itself took

    @property
    def num_steps(self) -> int:
        return sum(r.num_steps for r in self.replicas)

    @property
    def num_preemptions(self) -> int:
        return sum(r.num_preemptions for r in self.replicas)


def _prompt_ids(req: SimRequest, rng: random.Random, prefixes: dict, vocab: range) -> list[int]:
    """Random ids, so that prompts share no prefix by accident; a prefix group's requests
    share their first prefix_len ids."""
    ids: list[int] = []
    if req.prefix_group is not None and req.prefix_len:
        prefix = prefixes.get(req.prefix_group)
        if prefix is None or len(prefix) < req.prefix_len:
            prefix = rng.choices(vocab, k=req.prefix_len)
            prefixes[req.prefix_group] = prefix
        ids = prefix[:req.prefix_len]
    return ids + rng.choices(vocab, k=req.prompt_len - len(ids))


# How often a long simulation reports: its loop looks at the clock every _PROGRESS_EVERY events.
_PROGRESS_EVERY = 2048
PROGRESS_INTERVAL_S = 1.0


def simulate(cfg: SimConfig, cost_model: StepCostModel, requests: list[SimRequest],
             progress: Optional[Callable[[int], None]] = None) -> SimResult:
    """progress(requests finished so far) is called about every PROGRESS_INTERVAL_S of wall time
    (a 1000-request simulation of a big model runs for minutes)."""
    t0 = time.perf_counter()
    last_report = t0
    loops = 0
    requests = sorted(requests, key=lambda r: r.arrival_s)
    replicas = [SimReplica(cfg.replica, cost_model, i, cfg.record_steps,
                           ApiProcess(cfg.api) if cfg.api.active else None)
                for i in range(cfg.num_replicas)]
    router = Router(cfg.router, cfg.num_replicas)
    rng = random.Random(cfg.seed + 1)
    vocab = range(min(100, cfg.vocab_size - 1), cfg.vocab_size)
    prefixes: dict = {}
    records = [RequestRecord(f"sim-{i}", r.arrival_s, r.prompt_len, r.output_len)
               for i, r in enumerate(requests)]
    awake = [False] * len(replicas)
    events: list[tuple] = []  # (time, kind, counter, replica, request index)
    counter = 0
    i = 0
    while i < len(requests) or events:
        loops += 1
        if progress is not None and loops % _PROGRESS_EVERY == 0 and \
                time.perf_counter() - last_report >= PROGRESS_INTERVAL_S:
            last_report = time.perf_counter()
            progress(sum(1 for rec in records if rec.finish_s is not None))
        next_arrival = requests[i].arrival_s if i < len(requests) else math.inf
        if next_arrival <= (events[0][0] if events else math.inf):
            req = requests[i]
            ids = _prompt_ids(req, rng, prefixes, vocab)
            key = req.prefix_group if req.prefix_group is not None else tuple(ids[:cfg.replica.block_size])
            r = router.pick(replicas, [key])
            api = replicas[r].api
            admitted = api.admit(req.arrival_s) if api is not None else req.arrival_s
            records[i].admitted_s = admitted
            heapq.heappush(events, (admitted + cfg.ingress_s, _DELIVER, counter, r, (i, ids)))
            counter += 1
            i += 1
            continue
        now, kind, _, r, payload = heapq.heappop(events)
        replica = replicas[r]
        if kind == _DELIVER:
            index, ids = payload
            req = requests[index]
            records[index].delivered_s = now
            replica.add_request(records[index], ids, req.max_tokens or req.output_len, req.stops_early,
                                req.priority, now)
            if not awake[r]:
                awake[r] = True
                heapq.heappush(events, (now, _WAKE, counter, r, None))
                counter += 1
            continue
        following = replica.step_call(now)
        if following is None:
            awake[r] = False
            if replica.has_work():
                raise RuntimeError(f"replica {r} has unfinished requests but scheduled nothing "
                                   f"and has nothing in flight: they would never finish")
            continue
        heapq.heappush(events, (following, _WAKE, counter, r, None))
        counter += 1
    finished = [rec.finish_s for rec in records if rec.finish_s is not None]
    if progress is not None:
        progress(len(finished))
    start = min((r.arrival_s for r in requests), default=0.0)
    duration = (max(finished) - min(start, 0.0)) if finished else 0.0
    return SimResult(records, replicas, duration, time.perf_counter() - t0)
