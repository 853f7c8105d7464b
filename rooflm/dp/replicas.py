"""N engine cores for data parallelism, each in its own process on its own GPU or TP group.

Replica r of tensor-parallel size t gets the visible GPUs r*t .. r*t+t-1 as its
CUDA_VISIBLE_DEVICES (an index into the API process's own CUDA_VISIBLE_DEVICES
when that is set), so inside each core the ranks run on cuda:0 .. cuda:t-1 as they
would alone. On the CPU every replica just runs (they share the cores).

The cores start together (one thread each waits for its EngineReady) and share
one tokenizer, loaded here. ReplicaSet is the engine's face for the server as one
EngineCoreProcess is: info (replica 0's; every replica builds the same engine),
tokenizer, add_observer (every replica's steps). If one replica cannot start, the
others are closed before the error is raised: nothing is left running.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

from rooflm.config import EngineConfig
from rooflm.engine.core_process import EngineCoreProcess, EngineStartError, load_tokenizer
from rooflm.engine.report import EngineInfo, StepReport

logger = logging.getLogger(__name__)


def replica_gpus(config: EngineConfig, data_parallel_size: int) -> Optional[list[str]]:
    """Each replica's CUDA_VISIBLE_DEVICES, or None when the replicas run on the CPU.

    Raises ValueError when the host has too few GPUs for data x tensor parallel size."""
    device = config.device.device
    if device.startswith("cuda:") and data_parallel_size > 1:
        raise ValueError(f"with data parallelism replica r runs on its own GPUs; give --device "
                         f"cuda or auto (and CUDA_VISIBLE_DEVICES), not {device}")
    if device == "cpu":
        return None
    import torch

    if not torch.cuda.is_available():
        if device.startswith("cuda"):
            raise ValueError("--device cuda was given but no GPU is visible")
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = ([d.strip() for d in visible.split(",") if d.strip()] if visible
           else [str(i) for i in range(torch.cuda.device_count())])
    tp = config.parallel.tensor_parallel_size * config.parallel.pipeline_parallel_size  # GPUs a replica takes
    needed = data_parallel_size * tp
    if needed > len(ids):
        raise ValueError(f"data_parallel_size {data_parallel_size} x tensor_parallel_size "
                         f"{config.parallel.tensor_parallel_size} x pipeline_parallel_size "
                         f"{config.parallel.pipeline_parallel_size} needs {needed} GPUs; {len(ids)} are visible")
    return [",".join(ids[r * tp:(r + 1) * tp]) for r in range(data_parallel_size)]


class ReplicaSet:
    def __init__(self, replicas: list[EngineCoreProcess], placement_group=None):
        self.replicas = replicas
        self.placement_group = placement_group  # the Ray backend's, removed by close()
        self.info: EngineInfo = replicas[0].info
        self.tokenizer = replicas[0].tokenizer

    @classmethod
    def launch(cls, config: EngineConfig, data_parallel_size: int,
               backend: str = "mp") -> "ReplicaSet":
        """Start the cores and wait until every engine is built. Raises EngineStartError
        (a replica failed to start) or ValueError (too few GPUs).

        backend: "mp", processes of this host; "ray", one per bundle of a Ray placement group
        (dp/ray_core.py), on any node of the cluster."""
        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
        group = gpus = None
        if backend == "ray":
            from rooflm.dp.ray_core import RayEngineCore, replica_placement
            group = replica_placement(config, data_parallel_size)
        else:
            gpus = replica_gpus(config, data_parallel_size)
        try:
            tokenizer = load_tokenizer(config)
        except BaseException:
            _remove_placement_group(group)
            raise

        def start(r: int) -> EngineCoreProcess:
            if group is not None:
                return RayEngineCore.launch_in(config, group, r, tokenizer=tokenizer)
            env = {} if gpus is None else {"CUDA_VISIBLE_DEVICES": gpus[r]}
            return EngineCoreProcess.launch(config, env=env, tokenizer=tokenizer)

        with ThreadPoolExecutor(data_parallel_size, thread_name_prefix="rooflm-dp-start") as pool:
            futures = [pool.submit(start, r) for r in range(data_parallel_size)]
        started, errors = [], []
        for r, future in enumerate(futures):
            try:
                started.append(future.result())
            except BaseException as exc:  # noqa: BLE001 - close the others, then raise
                errors.append(f"replica {r}: {exc}")
        if errors:
            for core in started:
                core.close()
            _remove_placement_group(group)
            raise EngineStartError("; ".join(errors))
        for r, core in enumerate(started):
            if group is not None:
                where = f"Ray node {core.process.node_ip}"
            else:
                where = "CPU" if gpus is None else f"CUDA_VISIBLE_DEVICES={gpus[r]}"
            logger.info("data-parallel replica %d: engine core pid %d on %s", r,
                        core.process.pid, where)
        return cls(started, group)

    def __len__(self) -> int:
        return len(self.replicas)

    def add_observer(self, observer: Callable[[StepReport], None]) -> None:
        for core in self.replicas:
            core.add_observer(observer)

    def remove_observer(self, observer: Callable[[StepReport], None]) -> None:
        for core in self.replicas:
            core.remove_observer(observer)

    def close(self, timeout: float = 10.0) -> None:
        for core in self.replicas:
            core.close(timeout)
        _remove_placement_group(self.placement_group)
        self.placement_group = None


def _remove_placement_group(group) -> None:
    if group is not None:
        import ray
        ray.util.remove_placement_group(group)
