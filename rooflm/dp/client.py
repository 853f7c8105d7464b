"""DPClient: the front end over N engine cores, an EngineClient (engine/client.py) as one core's.

Behind it each replica (dp/replicas.py) has its own EngineCoreClient, sockets
and metric series (engine="<replica>", as vLLM labels its data-parallel engines).

generate() routes each group of requests whole (a group is admitted all or
nothing, so it cannot span replicas) with the Router (dp/router.py), by the
block hashes of its first prompt, against the router's own count of each
replica's unfinished requests and tokens (charged when a group is sent, so a
burst of arrivals spreads before any reply comes back; released as each request
finishes). A replica that refuses the group as busy (429) passes it to the next
least-loaded one; only when all refuse does the client see 429.

Restart (RestartPolicy, engine/core_client.py): a replica whose core dies is
restarted on its own; while it starts, the router sends nothing there (a group
routed to it goes to the least-loaded live replica), and /health names it (503).
Only a replica that stays down (its crash-loop guard tripped, or restart off)
is a failure, by vLLM's rule: one dead engine core is a dead engine. /health names
the replica and answers 503, the other replicas' requests are aborted, and the
server exits (or stays up answering 503 with --keep-running-on-error). A
replica that lives on after its sibling died would keep a half-capacity server
looking healthy to a load balancer that should have replaced it.

keep_serving (the Ray backend's choice: replicas on other hosts, whose node may be lost
with its replica): a replica that stays down is dropped instead. Its requests fail, the
router sends nothing more there, the others keep serving; the error log names it and
lost_replicas keeps why. Only when every replica is lost is the engine dead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Callable, Optional

from rooflm.dp.replicas import ReplicaSet
from rooflm.dp.router import Router
from rooflm.engine.block_manager import hash_block
from rooflm.engine.client import EngineClient, RequestStream
from rooflm.engine.core_client import EngineCoreClient, RestartPolicy
from rooflm.engine.report import EngineSnapshot, SpecSnapshot, merge_lora_snapshots
from rooflm.engine.request_types import (AdmissionLimits, AdmissionRejected, EngineDeadError,
                                         GenerateRequest)

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ReplicaLoad:
    """The router's view of a replica: what it sent there that has not finished."""

    num_unfinished: int = 0
    outstanding_tokens: int = 0  # prompt + n * max_tokens of those requests

    def charge(self, requests: list[GenerateRequest], sign: int) -> None:
        self.num_unfinished += sign * len(requests)
        self.outstanding_tokens += sign * sum(r.reserved_tokens for r in requests)


class DPClient(EngineClient):
    def __init__(self, engine: ReplicaSet, limits: Optional[AdmissionLimits] = None,
                 metrics=None, policy: str = "cache_aware",
                 restart: Optional[RestartPolicy] = None, keep_serving: bool = False):
        """engine: launched replicas, owned by this client from start() on. limits apply to
        each replica (its own queue and KV pool). metrics: a ServerMetrics (replica r writes
        its for_engine(r) series) or None. restart: each replica's, on its own."""
        self.engine = engine
        self.clients: list[EngineCoreClient] = []
        self.loads: list[ReplicaLoad] = []
        for r, core in enumerate(engine.replicas):
            replica_metrics = None if metrics is None else metrics.for_engine(str(r))
            client = self.make_client(core, limits, replica_metrics, restart)
            client.on_request_done = lambda request, r=r: self._request_done(r, request)
            self.clients.append(client)
            self.loads.append(ReplicaLoad())
        info = engine.info
        self.block_size = info.block_size
        # About one KV pool of blocks per replica: older prefixes are likely evicted there too.
        self.router = Router(policy, len(self.clients), index_blocks=max(info.num_blocks, 1))
        self._owner: dict[str, int] = {}  # request id -> replica, until it is done
        self._dead: Optional[str] = None
        self.keep_serving = keep_serving
        self.lost_replicas: dict[int, str] = {}  # replica -> why, under keep_serving
        self._on_dead: Optional[Callable[[BaseException], None]] = None

    @staticmethod
    def make_client(core, limits: Optional[AdmissionLimits], metrics,
                    restart: Optional[RestartPolicy] = None) -> EngineCoreClient:
        """One replica's client (the unit tests put a stand-in here)."""
        return EngineCoreClient(core, limits, metrics, restart)

    # ---- lifecycle -----------------------------------------------------------------------------------

    def start(self, on_dead: Optional[Callable[[BaseException], None]] = None) -> None:
        self._on_dead = on_dead
        for r, client in enumerate(self.clients):
            client.start(on_dead=lambda exc, r=r: self._replica_dead(r, exc))

    async def shutdown(self, timeout: float = 10.0) -> None:
        await asyncio.gather(*(client.shutdown(timeout) for client in self.clients))

    def stop(self, timeout: float = 10.0) -> None:
        for client in self.clients:
            client.stop(timeout)

    # ---- requests ------------------------------------------------------------------------------------

    async def generate(self, requests: list[GenerateRequest],
                       bypass_limits: bool = False) -> list[RequestStream]:
        """Admit a group on one replica (routed as the module docstring says), all together or
        not at all: a group cannot span replicas."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine failed: {self._dead}")
        # Only the cache-aware policy reads the prompt: hashing costs ~0.4 us a token (6 ms for
        # 16k tokens on this CI CPU), on the event loop.
        hashes = self.block_hashes(requests[0]) if self.router.policy == "cache_aware" else None
        first = self.router.pick(self.loads, hashes)
        others = sorted((r for r in range(len(self.clients)) if r != first),
                        key=lambda r: (self.loads[r].num_unfinished, r))
        # A replica whose core is restarting goes last: its generate() waits for the new core.
        order = sorted([first] + others, key=self._is_restarting)
        order = [r for r in order if r not in self.lost_replicas]
        for attempt, replica in enumerate(order):
            try:
                return await self._generate_on(replica, requests, bypass_limits)
            except AdmissionRejected:
                if attempt == len(order) - 1:
                    raise
        raise AssertionError("unreachable: the last refusal is raised")

    async def _generate_on(self, replica: int, requests: list[GenerateRequest],
                           bypass_limits: bool) -> list[RequestStream]:
        self.loads[replica].charge(requests, +1)
        for request in requests:
            self._owner[request.request_id] = replica
        try:
            return await self.clients[replica].generate(requests, bypass_limits)
        except BaseException:
            # Refused, or the caller gave up before the reply: nothing was tracked there.
            self.loads[replica].charge(requests, -1)
            for request in requests:
                self._owner.pop(request.request_id, None)
            raise

    def _is_restarting(self, replica: int) -> bool:
        return getattr(self.clients[replica], "is_restarting", False)

    def _request_done(self, replica: int, request: GenerateRequest) -> None:
        self.loads[replica].charge([request], -1)
        self._owner.pop(request.request_id, None)

    def block_hashes(self, request: GenerateRequest) -> list[bytes]:
        """The prompt's whole blocks as the engine's prefix cache keys them (never the last
        token: the engine recomputes it for its logits)."""
        ids = request.prompt_token_ids
        size = self.block_size
        hashes: list[bytes] = []
        parent = None
        for i in range((len(ids) - 1) // size):
            parent = hash_block(parent, ids[i * size:(i + 1) * size], request.cache_salt)
            hashes.append(parent)
        return hashes

    def abort(self, request_ids: list[str], reason: Optional[str] = None) -> None:
        by_replica: dict[int, list[str]] = {}
        for request_id in request_ids:
            replica = self._owner.pop(request_id, None)
            if replica is not None:
                by_replica.setdefault(replica, []).append(request_id)
        for replica, ids in by_replica.items():
            self.clients[replica].abort(ids, reason)

    def abort_all(self, reason: str) -> None:
        for client in self.clients:
            client.abort_all(reason)

    async def sleep(self, level: int = 1) -> None:
        """Every replica sleeps (one engine, as for failure: a half-asleep server would look
        ready with half its capacity)."""
        await asyncio.gather(*(client.sleep(level) for client in self.clients))

    async def wake_up(self) -> Optional[dict]:
        """The slowest replica's phases (the server is ready when it is)."""
        phases = [p for p in await asyncio.gather(*(client.wake_up() for client in self.clients)) if p]
        return max(phases, key=lambda p: p["total_s"], default=None)

    @property
    def is_sleeping(self) -> bool:
        return any(client.is_sleeping for client in self.clients)

    def health(self, stall_seconds: float) -> Optional[str]:
        """None while every replica is alive and making progress; else which one and why."""
        reasons = [f"data-parallel replica {r}: {reason}"
                   for r, client in enumerate(self.clients)
                   if r not in self.lost_replicas and (reason := client.health(stall_seconds)) is not None]
        if self._dead is not None:
            reasons.append(self._dead)
        return "; ".join(reasons) or None

    @property
    def is_dead(self) -> bool:
        if self.keep_serving:
            return self._dead is not None
        return self._dead is not None or any(client.is_dead for client in self.clients)

    @property
    def is_restarting(self) -> bool:
        """Every replica is restarting: nothing can run until one is back."""
        return all(self._is_restarting(r) for r in range(len(self.clients))
                   if r not in self.lost_replicas)

    @property
    def num_in_flight(self) -> int:
        return sum(client.num_in_flight for client in self.clients)

    @property
    def snapshot(self) -> EngineSnapshot:
        """Every replica's state, summed (the log line's totals)."""
        return sum_snapshots([client.snapshot for client in self.clients])

    # ---- failure -------------------------------------------------------------------------------------

    def _replica_dead(self, replica: int, exc: BaseException) -> None:
        if self._dead is not None:
            return
        if self.keep_serving:
            self.lost_replicas[replica] = str(exc)
            for request_id in [i for i, r in self._owner.items() if r == replica]:
                self._owner.pop(request_id)  # its client failed them already
            if len(self.lost_replicas) < len(self.clients):
                logger.error("data-parallel replica %d is lost (%s); the router sends nothing "
                             "more there, %d replicas keep serving", replica, exc,
                             len(self.clients) - len(self.lost_replicas))
                return
        self._dead = f"data-parallel replica {replica}: {exc}"
        logger.error("data-parallel replica %d failed; the engine is dead (vLLM's rule): "
                     "aborting the other replicas' requests", replica)
        for r, client in enumerate(self.clients):
            if r != replica:
                client.abort_all(f"the engine failed: {self._dead}")
        self._owner.clear()
        if self._on_dead is not None:
            self._on_dead(EngineDeadError(f"the engine failed: {self._dead}"))


def sum_snapshots(snapshots: list[EngineSnapshot]) -> EngineSnapshot:
    """One snapshot whose counts are the replicas' sums; the predicted wait is the least
    (the router sends a request where the load is least), sleeping is any replica's."""
    fields = {}
    for field in dataclasses.fields(EngineSnapshot):
        if field.name in ("spec", "predicted_wait_s", "is_sleeping", "lora"):
            continue
        fields[field.name] = sum(getattr(s, field.name) for s in snapshots)
    fields["predicted_wait_s"] = min(s.predicted_wait_s for s in snapshots)
    fields["is_sleeping"] = any(s.is_sleeping for s in snapshots)
    specs = [s.spec for s in snapshots if s.spec is not None]
    fields["lora"] = merge_lora_snapshots([s.lora for s in snapshots if s.lora is not None])
    return EngineSnapshot(**fields, spec=_sum_specs(specs) if specs else None)


def _sum_specs(specs: list[SpecSnapshot]) -> SpecSnapshot:
    width = max(len(s.accepted_per_pos) for s in specs)
    per_pos = tuple(sum(s.accepted_per_pos[i] for s in specs if i < len(s.accepted_per_pos))
                    for i in range(width))
    return SpecSnapshot(sum(s.num_drafts for s in specs), sum(s.num_draft_tokens for s in specs),
                        sum(s.num_accepted_tokens for s in specs), per_pos,
                        sum(s.draft_s for s in specs), sum(s.verify_s for s in specs))
