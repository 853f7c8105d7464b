"""The Ray backends on a local cluster of two simulated nodes (127.0.0.1), on the CPU.

One cluster for the module (ray.cluster_utils.Cluster: a head and one more node, each with its
own raylet), torn down at the end. On it:
  - --data-parallel-backend ray: two engine cores, one per node, reached over tcp:// with HMAC
    on every frame, give the tokens one in-process engine gives; a forged frame is dropped and
    counted; a replica whose process dies is dropped by the router and the other keeps serving;
  - --distributed-executor-backend ray: TP=3 (gloo; 9 query heads, 3 KV heads) with its two
    workers in one placement group, one on each node (a node has one CPU: rank 0 on the driver's
    host, the group spans "hosts"), gives the tokens TP=1 gives; a worker killed mid-request
    fails the engine naming it.
One CPU per node keeps Ray's pre-started worker processes, and the file's time, down.
Without Ray installed only the first test runs: the flags are refused, naming the extra.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import time

import pytest

from rooflm.config import ParallelConfig
from rooflm.engine.frame_auth import FrameAuth, new_secret
from rooflm.sampling_params import SamplingParams
from tests.distributed.test_tensor_parallel import _kill_a_worker_mid_request

PROMPTS = [[5, 9, 33, 7, 81, 12], [100, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [17]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# Bounds on waiting for something the cluster does; a test that waits longer has failed.
DEADLINE_S = 60.0
pytestmark = pytest.mark.timeout(300)


def test_ray_flags_are_refused_without_ray_naming_the_extra(monkeypatch):
    from rooflm.server.config import ServerConfig

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ValueError, match=r"distributed_executor_backend .*pip install 'rooflm\[ray\]'"):
        ParallelConfig(distributed_executor_backend="ray")
    with pytest.raises(ValueError, match=r"data_parallel_backend .*pip install 'rooflm\[ray\]'"):
        ServerConfig(data_parallel_backend="ray")
    with pytest.raises(ValueError, match="must be one of mp, ray"):
        ParallelConfig(distributed_executor_backend="slurm")


def test_frame_auth_drops_forged_tampered_and_replayed_frames():
    sender, receiver = FrameAuth(secret := new_secret()), FrameAuth(secret)
    first, second = sender.seal(b"\x81\xa1a\x01"), sender.seal(b"\x81\xa1a\x02")
    assert receiver.open(first) == b"\x81\xa1a\x01"
    forged = FrameAuth(new_secret()).seal(b"\x81\xa1a\x03")
    tampered = bytes([second[0] ^ 1]) + second[1:]
    for bad in (forged, tampered, b"\x81\xa1a\x03", first):  # the last: a replay
        assert receiver.open(bad) is None
    assert receiver.open(second) == b"\x81\xa1a\x02"
    assert receiver.num_dropped == 4
    assert FrameAuth(None).seal(b"x") == b"x"  # ipc:// on one host: frames as they are


# ---- on a two-node cluster ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    # Every Ray process of the cluster on the loopback address (Ray's own switch, read when
    # ray is imported and by each process it starts): nothing listens on a public interface.
    saved = os.environ.get(LOOPBACK_ENV)
    os.environ[LOOPBACK_ENV] = "0"
    pytest.importorskip("ray", reason="Ray is an optional extra (pip install 'rooflm[ray]')")
    import ray
    from ray.cluster_utils import Cluster

    # On the main thread: Ray's nodes install signal handlers.
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        nodes.add_node(num_cpus=1)
        ray.init(address=nodes.address, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
        nodes.wait_for_nodes(DEADLINE_S)
        assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
        yield nodes
    finally:
        ray.shutdown()
        nodes.shutdown()
        if saved is None:
            os.environ.pop(LOOPBACK_ENV, None)
        else:
            os.environ[LOOPBACK_ENV] = saved


LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny Llama with 9 query heads and 3 KV heads (TP=3 splits both), and its TP=1 tokens."""
    from rooflm import LLM
    from tests.models.tiny_models import make_tiny_model

    path, _ = make_tiny_model(tmp_path_factory.mktemp("ray"), "llama", hidden_size=72,
                              num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=2)
    llm = LLM(model=str(path), dtype="float32", device="cpu")
    try:
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.shutdown()
    return str(path), tokens


def test_tp3_workers_in_one_placement_group_give_the_tokens_of_tp1(cluster, model):
    from rooflm import LLM
    from rooflm.distributed.ray_process import RayProcess

    path, expected = model
    llm = LLM(model=path, dtype="float32", device="cpu", tensor_parallel_size=3,
              distributed_executor_backend="ray")
    try:
        executor = llm.engine.executor
        assert all(isinstance(p, RayProcess) for p in executor.processes)
        assert len(executor.processes) == 2 and executor.placement_group is not None
        assert len({p.node_id for p in executor.processes}) == 2
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        assert got == expected
        # A worker killed mid-request fails the engine's next steps, naming it, as under mp.
        _kill_a_worker_mid_request(llm.engine)
    finally:
        llm.shutdown()
    assert not any(p.is_alive() for p in executor.processes)


def test_dp2_across_two_nodes(cluster, model):
    from rooflm.config import engine_config_from_kwargs
    from rooflm.dp.replicas import ReplicaSet

    path, expected = model
    replicas = ReplicaSet.launch(engine_config_from_kwargs(model=path, dtype="float32", device="cpu"),
                                 2, backend="ray")
    try:
        assert len({core.process.node_id for core in replicas.replicas}) == 2
        asyncio.run(_serve_on_two_nodes(replicas, expected))
    finally:
        replicas.close()
    assert not any(core.process.is_alive() for core in replicas.replicas)


async def _serve_on_two_nodes(replicas, expected) -> None:
    import zmq

    from rooflm.dp.client import DPClient

    client = DPClient(replicas, policy="round_robin", keep_serving=True)
    client.start()
    try:
        served_by: dict[str, int] = {}
        assert await _generate(client, "a", served_by) == expected
        assert set(served_by.values()) == {0, 1}  # round robin: both nodes served
        # A frame from someone without the secret reaches the API process's tcp:// socket:
        # dropped and counted, never decoded.
        core = replicas.replicas[0]
        rogue = zmq.Context.instance().socket(zmq.PUSH)
        rogue.connect(core.output_socket.getsockopt(zmq.LAST_ENDPOINT).decode())
        rogue.send(b"\x81\xa4kind\xa4dead")
        await _until(lambda: core.frames.num_dropped == 1)
        rogue.close(linger=0)
        # Replica 1's process dies: the router drops it, replica 0 serves everything.
        os.kill(replicas.replicas[1].process.pid, signal.SIGKILL)
        await _until(lambda: 1 in client.lost_replicas)
        assert not client.is_dead
        served_by.clear()
        assert await _generate(client, "b", served_by) == expected
        assert set(served_by.values()) == {0}
    finally:
        await client.shutdown(timeout=10)


async def _generate(client, tag: str, served_by: dict[str, int]) -> list[list[int]]:
    """Greedy tokens per prompt, one request at a time; served_by: request id -> replica."""
    from rooflm.engine.request_types import GenerateRequest

    results = []
    for i, prompt in enumerate(PROMPTS):
        [stream] = await client.generate([GenerateRequest(f"{tag}{i}", prompt, GREEDY)])
        served_by[f"{tag}{i}"] = client._owner[f"{tag}{i}"]
        while True:
            out = await stream.next(timeout=DEADLINE_S)
            if out.finished:
                results.append(list(out.outputs[0].token_ids))
                break
    return results


async def _until(condition) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, "the cluster did not get there in time"
        await asyncio.sleep(0.05)
