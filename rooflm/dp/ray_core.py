"""Data-parallel engine cores on the nodes of a Ray cluster (--data-parallel-backend ray).

Each replica is the engine-core process mp starts (engine/core.py), started on the node of
its placement-group bundle by a small actor (distributed/ray_process.py). The API server
reaches it over ZMQ as it reaches a local core, with two changes for a socket another host
can reach:
  - tcp:// instead of ipc://: the core binds its input on its node's address (a port its
    actor found free there), the API process binds its output on its own;
  - every frame carries an HMAC under a secret drawn here for that core and handed to it
    through Ray (engine/frame_auth.py): a frame from anyone else is dropped and counted.
Frames stay msgpack. A replica whose process, actor or node dies reads as an exited core
(its sentinel), so the client's restart and the router's handling apply unchanged.

The bundles: one per replica ({"CPU": 1} plus its GPUs: tensor x pipeline parallel size),
strategy SPREAD, so replicas land on different nodes where the cluster has them.
"""

from __future__ import annotations

import atexit
import logging
import os
from typing import Optional

import msgspec
import zmq

from rooflm.config import EngineConfig
from rooflm.distributed.ray_process import (RayProcess, connect_cluster, forwarded_environment,
                                            import_ray, node_ip)
from rooflm.engine.core_process import EngineCoreProcess, _cpu_environment
from rooflm.engine.core import run_engine_core
from rooflm.engine.frame_auth import FrameAuth, new_secret

logger = logging.getLogger(__name__)


def replica_placement(config: EngineConfig, data_parallel_size: int):
    """A placement group with one bundle per replica, ready (blocks until the cluster has
    reserved it). Raises ValueError naming what the cluster lacks."""
    ray = import_ray()
    from ray.util.placement_group import placement_group

    connect_cluster()
    gpus = 0 if config.device.device == "cpu" else (config.parallel.tensor_parallel_size
                                                    * config.parallel.pipeline_parallel_size)
    bundle = {"CPU": 1, **({"GPU": gpus} if gpus else {})}
    if gpus == 0 and config.device.device == "auto" and ray.cluster_resources().get("GPU", 0):
        raise ValueError("--data-parallel-backend ray on a cluster with GPUs: give --device cuda "
                         "(or cpu) so each replica's bundle reserves what it will use")
    group = placement_group([dict(bundle) for _ in range(data_parallel_size)], strategy="SPREAD",
                            name="rooflm-dp")
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        ray.util.remove_placement_group(group)
        raise ValueError(f"the Ray cluster could not place {data_parallel_size} replicas of "
                         f"{bundle} within {PLACEMENT_TIMEOUT_S:.0f} s (resources: "
                         f"{ray.cluster_resources()})")
    return group


# How long the cluster gets to reserve the replicas' bundles (a node may be starting).
PLACEMENT_TIMEOUT_S = 120.0


class RayEngineCore(EngineCoreProcess):
    """An engine core placed on bundle `bundle_index` of `group`."""

    @classmethod
    def launch_in(cls, config: EngineConfig, group, bundle_index: int,
                  tokenizer=None) -> "RayEngineCore":
        core = cls._spawn_in(config, group, bundle_index)
        try:
            core.tokenizer = tokenizer
            if tokenizer is None:
                from rooflm.engine.core_process import load_tokenizer
                core.tokenizer = load_tokenizer(config)
            core._become_ready()
        except BaseException:
            core.close(timeout=0)
            raise
        return core

    def _spawn_again(self) -> "RayEngineCore":
        return type(self)._spawn_in(*self._placement)

    @classmethod
    def _spawn_in(cls, config: EngineConfig, group, bundle_index: int) -> "RayEngineCore":
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpus = group.bundle_specs[bundle_index].get("GPU", 0)
        strategy = PlacementGroupSchedulingStrategy(placement_group=group,
                                                    placement_group_bundle_index=bundle_index)
        process = RayProcess(f"rooflm-engine-core-{bundle_index}",
                             {"num_cpus": 1, "num_gpus": gpus, "scheduling_strategy": strategy})
        process.create()
        secret = new_secret()
        context = zmq.Context()
        output_socket = context.socket(zmq.PULL)
        # Bound on this node's cluster address only, not every interface.
        output_port = output_socket.bind_to_random_port(f"tcp://{node_ip()}")
        input_address = f"tcp://{process.node_ip}:{process.free_port()}"
        input_socket = context.socket(zmq.PUSH)
        input_socket.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a send
        input_socket.connect(input_address)
        core = cls(process, context, input_socket, output_socket, None, FrameAuth(secret))
        core._launch_args = (config, {})
        core._placement = (config, group, bundle_index)
        args = ({}, msgspec.msgpack.encode(config), input_address,
                f"tcp://{node_ip()}:{output_port}", logging.getLogger().getEffectiveLevel(),
                logging.getLogger("rooflm").getEffectiveLevel(), secret)
        try:
            process.start(_run_remote_core, args, env={**forwarded_environment(),
                                                       **_cpu_environment(config)})
        except BaseException:
            core.close(timeout=0)
            raise
        atexit.register(core.close)
        logger.info("data-parallel replica %d: engine core pid %d on node %s (%s)", bundle_index,
                    process.pid, process.node_ip, process.node_id)
        return core

    def close(self, timeout: float = 10.0) -> None:
        closed = self._closed
        super().close(timeout)
        if not closed:
            self.process.release()


def _run_remote_core(env: dict[str, str], config_bytes: bytes, input_address: str,
                     output_address: str, log_level: int, rooflm_log_level: int,
                     secret: bytes) -> None:
    """The core's entry point on its node: its parent is the actor, whose end ends it."""
    os.environ.update(env)
    run_engine_core(config_bytes, input_address, output_address, os.getppid(), log_level,
                    rooflm_log_level, secret)
