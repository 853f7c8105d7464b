"""DPClient's own logic over stand-in replica clients (no processes): load is charged when a
group is sent and released when it finishes, a busy replica passes the group on, aborts reach
the owner, and one dead replica is a dead engine (vLLM's rule)."""

import asyncio
from types import SimpleNamespace

import pytest

from rooflm.dp.client import DPClient
from rooflm.engine.request_types import AdmissionRejected, EngineDeadError, GenerateRequest
from rooflm.sampling_params import SamplingParams


class StandInClient:
    """What DPClient uses of an EngineCoreClient; admits at once, finishes when told."""

    def __init__(self, core, limits, metrics, restart=None):
        self.index = core.index
        self.is_restarting = False
        self.admitted: list[GenerateRequest] = []
        self.aborted: list = []
        self.busy = False
        self.dead: str | None = None
        self.on_request_done = None
        self.on_dead = None

    def start(self, on_dead=None):
        self.on_dead = on_dead

    async def generate(self, requests, bypass_limits=False):
        if self.busy:
            raise AdmissionRejected("busy")
        self.admitted += requests
        return [object() for _ in requests]

    def finish(self, request_id: str):
        request = next(r for r in self.admitted if r.request_id == request_id)
        self.on_request_done(request)

    def abort(self, request_ids, reason=None):
        self.aborted.append(list(request_ids))
        for request_id in request_ids:
            self.finish(request_id)

    def abort_all(self, reason):
        self.aborted.append(("all", reason))

    def health(self, stall_seconds):
        return None if self.dead is None else f"the engine failed: {self.dead}"

    @property
    def is_dead(self):
        return self.dead is not None

    def die(self, error: str):
        self.dead = error
        self.on_dead(EngineDeadError(f"the engine failed: {error}"))


class StandInDPClient(DPClient):
    make_client = staticmethod(StandInClient)


def _client(policy: str, replicas: int = 2) -> StandInDPClient:
    engine = SimpleNamespace(replicas=[SimpleNamespace(index=i) for i in range(replicas)],
                             info=SimpleNamespace(block_size=4, num_blocks=100))
    return StandInDPClient(engine, policy=policy)


def _request(i: int, prompt=None, max_tokens: int = 10) -> GenerateRequest:
    return GenerateRequest(f"r{i}", prompt or [i + 1] * 3, SamplingParams(max_tokens=max_tokens))


def test_a_burst_spreads_before_any_reply_and_finishing_releases_the_load():
    async def run():
        dp = _client("least_loaded")
        dp.start()
        await asyncio.gather(*(dp.generate([_request(i)]) for i in range(4)))
        assert [len(c.admitted) for c in dp.clients] == [2, 2]
        assert [load.num_unfinished for load in dp.loads] == [2, 2]
        assert dp.loads[0].outstanding_tokens == 2 * (3 + 10)
        dp.clients[0].finish(dp.clients[0].admitted[0].request_id)
        assert [load.num_unfinished for load in dp.loads] == [1, 2]
        await dp.generate([_request(9)])  # the least loaded now
        assert dp.clients[0].admitted[-1].request_id == "r9"
    asyncio.run(run())


def test_a_busy_replica_passes_the_group_on_and_all_busy_is_429():
    async def run():
        dp = _client("round_robin")
        dp.start()
        dp.clients[0].busy = True
        await dp.generate([_request(0)])  # round-robin picks 0, which refuses
        assert [len(c.admitted) for c in dp.clients] == [0, 1]
        assert [load.num_unfinished for load in dp.loads] == [0, 1]
        dp.clients[1].busy = True
        with pytest.raises(AdmissionRejected):
            await dp.generate([_request(1)])
        assert [load.num_unfinished for load in dp.loads] == [0, 1]
    asyncio.run(run())


def test_cache_aware_keeps_a_shared_prompt_on_its_replica_and_aborts_reach_the_owner():
    async def run():
        dp = _client("cache_aware")
        dp.start()
        shared = list(range(1, 41))  # 10 blocks of 4
        await dp.generate([_request(0, shared + [90])])
        await dp.generate([_request(1, [7] * 9)])  # nothing shared: the idle replica
        await dp.generate([_request(2, shared + [91])])  # back to the busier one
        assert [[r.request_id for r in c.admitted] for c in dp.clients] == [["r0", "r2"], ["r1"]]
        dp.abort(["r2", "unknown"])
        assert dp.clients[0].aborted == [["r2"]] and dp.clients[1].aborted == []
        assert dp.loads[0].num_unfinished == 1
    asyncio.run(run())


def test_one_dead_replica_is_a_dead_engine():
    async def run():
        dp = _client("least_loaded", replicas=3)
        deaths = []
        dp.start(on_dead=deaths.append)
        dp.clients[1].die("RuntimeError: boom")
        assert dp.is_dead and len(deaths) == 1
        assert "data-parallel replica 1" in str(deaths[0])
        assert dp.clients[0].aborted[0][0] == "all" and dp.clients[2].aborted[0][0] == "all"
        assert dp.clients[1].aborted == []
        assert "data-parallel replica 1" in dp.health(30.0)
        with pytest.raises(EngineDeadError, match="replica 1"):
            await dp.generate([_request(0)])
    asyncio.run(run())


def test_keep_serving_drops_a_lost_replica_and_the_others_serve():
    """The Ray backend's rule: a replica that stays down is dropped, not the engine."""
    async def run():
        engine = SimpleNamespace(replicas=[SimpleNamespace(index=i) for i in range(3)],
                                 info=SimpleNamespace(block_size=4, num_blocks=100))
        dp = StandInDPClient(engine, policy="round_robin", keep_serving=True)
        deaths = []
        dp.start(on_dead=deaths.append)
        dp.clients[1].die("RuntimeError: node lost")
        assert not dp.is_dead and deaths == [] and "node lost" in dp.lost_replicas[1]
        assert all(c.aborted == [] for c in dp.clients)  # the others' requests go on
        assert dp.health(30.0) is None
        for i in range(4):
            await dp.generate([_request(i)])
        assert dp.clients[1].admitted == []
        assert len(dp.clients[0].admitted) + len(dp.clients[2].admitted) == 4
        dp.clients[0].die("RuntimeError: node lost")
        dp.clients[2].die("RuntimeError: node lost")
        assert dp.is_dead and len(deaths) == 1 and "data-parallel replica 2" in dp.health(30.0)
        with pytest.raises(EngineDeadError):
            await dp.generate([_request(9)])
    asyncio.run(run())
