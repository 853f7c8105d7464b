"""The engine's handle on its tensor- and pipeline-parallel workers: start them, watch them, stop them.

With pipeline parallelism (distributed/pipeline.py) there are PP x TP ranks, rank =
stage * TP + tp_rank; everything below holds for all of them (rank 0 is stage 0's TP rank 0).

Rank 0 is the engine's own process (LLMEngine, in-process or in the engine-core process):
it schedules, runs its shard of the model and samples. Ranks 1..N-1 are worker processes
(worker.py), started here with multiprocessing spawn and joined through a TCP store on
127.0.0.1; under torchrun (RANK / WORLD_SIZE in the environment) the ranks are torchrun's
processes instead: rank 0 goes on as the engine, the others turn into workers when they build
the engine and exit when rank 0 stops them. torchrun's env:// rendezvous reaches other hosts.

With --distributed-executor-backend ray the workers are the same processes, started on the
nodes of a Ray cluster instead: one placement group (PACK) of a bundle per worker, each
bundle's actor starting run_ray_worker there (distributed/ray_process.py), and the TCP store
on rank 0's cluster address. The step broadcast and the gloo/NCCL data plane are unchanged;
the watcher sees a worker's end, or its node's, through the same sentinels. A worker that
raises sends its WorkerError to its actor through a pipe on its node, and the actor hands it
back through Ray when the worker has exited: WorkerDied carries its rank and traceback too.

A worker that dies is seen at once: a watcher thread waits on the processes' sentinels and on
one pipe per worker, terminates the other workers and aborts the group, so that rank 0's
collectives raise instead of waiting; the engine then raises WorkerDied at its next step (and
check_alive()), which the engine-core process reports as EngineDead: the server answers 503,
nothing is left running. A worker that raises (rather than being killed) sends its traceback
through its pipe before it exits, and WorkerDied carries that rank and traceback.

Teardown: rank 0 releases its CUDA graphs (the callable given to release_before_shutdown),
sends stop, and every rank meets at a barrier and leaves the group on a thread bounded to
DESTROY_TIMEOUT_S (group.destroy_group): a stuck NCCL cannot hang the exit.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.connection
import os
import socket
import sys
import threading
from typing import Optional

import torch

from rooflm.config import EngineConfig, ModelConfig
from rooflm.distributed.group import TPGroup, abort_group, check_divisible, destroy_group, visible_devices
from rooflm.distributed.pipeline import ParallelGroups, configured_partition, init_parallel
from rooflm.distributed.hang_dump import HangWatch
from rooflm.distributed.step_broadcast import StepChannel

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 10.0


class WorkerDied(RuntimeError):
    """A tensor-parallel worker is gone. rank: which (None if unknown); traceback: its own,
    when it raised (None when it was killed or crashed)."""

    def __init__(self, message: str, rank: Optional[int] = None, traceback: Optional[str] = None):
        super().__init__(message)
        self.rank = rank
        self.traceback = traceback


def check_tensor_parallel(size: int, model_config: ModelConfig, device: torch.device) -> None:
    """Refuse, before anything starts, a size the model or the host cannot take (ValueError)."""
    check_divisible(model_config.num_attention_heads, model_config.num_key_value_heads, size)
    visible = visible_devices(device)
    if visible is not None and size > visible:
        raise ValueError(f"tensor_parallel_size {size} exceeds the {visible} visible GPU(s) "
                         f"(one GPU per rank; CUDA_VISIBLE_DEVICES selects them)")
    if device.type == "cuda" and device.index not in (None, 0):
        raise ValueError(f"with tensor parallelism rank r runs on cuda:r; give --device cuda "
                         f"(and CUDA_VISIBLE_DEVICES), not {device}")


def check_pipeline_parallel(size: int, tp_size: int, model_config: ModelConfig, device: torch.device) -> None:
    """Refuse, before anything starts, stages the model or the host cannot take (ValueError)."""
    configured_partition(model_config.num_hidden_layers, size)  # raises on too many stages
    visible = visible_devices(device)
    if visible is not None and size * tp_size > visible:
        raise ValueError(f"pipeline_parallel_size {size} x tensor_parallel_size {tp_size} needs "
                         f"{size * tp_size} GPUs; {visible} visible (one GPU per rank)")


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


class TPExecutor:
    def __init__(self, tp: TPGroup, processes: list[multiprocessing.process.BaseProcess],
                 error_pipes: Optional[list] = None, watch: Optional[HangWatch] = None,
                 groups: Optional[ParallelGroups] = None, placement_group=None):
        self.tp = tp  # rank 0's TP group (stage 0's under pipeline parallelism)
        groups = groups or ParallelGroups(tp, tp)
        self.world = groups.world  # every rank: the step broadcast, stop and teardown
        self.stage = groups.stage  # rank 0's pipeline stage, or None
        self.processes = processes
        self.placement_group = placement_group  # the Ray backend's, removed at shutdown
        # The receiving end of each worker's error pipe (worker.WorkerError), by process.
        self.error_pipes = dict(zip(processes, error_pipes or []))
        self.watch = watch or HangWatch(0, seconds=0)
        self.error: Optional[str] = None  # set when a worker died
        self.error_rank: Optional[int] = None
        self.error_traceback: Optional[str] = None
        self._release = None  # rank 0's ModelRunner.release_graphs
        self._eof: set = set()  # error pipes whose worker exited without a report
        self._stopping = False
        self._lock = threading.Lock()
        if processes:
            threading.Thread(target=self._watch, name="rooflm-tp-watch", daemon=True).start()
        # At exit without shutdown(), the workers are stopped the same way (tearing gloo down
        # under a peer that still talks to it can abort the process: group.destroy_group).
        atexit.register(self.shutdown)

    @classmethod
    def start(cls, config: EngineConfig, model_config: ModelConfig, max_model_len: int,
              model_path: str, load_format: str) -> "TPExecutor":
        """Start ranks 1..N-1 and join the group as rank 0 (blocks until every rank has)."""
        from rooflm.engine.worker import rank_device, run_worker
        from rooflm.engine.model_runner import resolve_device

        tp_size = config.parallel.tensor_parallel_size
        pp_size = config.parallel.pipeline_parallel_size
        size = tp_size * pp_size
        base = resolve_device(config.device.device)
        check_tensor_parallel(tp_size, model_config, base)
        check_pipeline_parallel(pp_size, tp_size, model_config, base)
        layers = configured_partition(model_config.num_hidden_layers, pp_size)
        args = (config, model_config, max_model_len, model_path, load_format)
        processes, pipes = [], []
        placement = None
        watch = HangWatch(0)
        if launched_by_torchrun():
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            if world != size:
                raise ValueError(f"torchrun started {world} processes but tensor_parallel_size x "
                                 f"pipeline_parallel_size is {size}")
            init_method = "env://"
            if rank != 0:  # this process is a worker from here on
                run_worker(rank, size, init_method, *args, parent_pid=0)
                sys.exit(0)
        elif config.parallel.distributed_executor_backend == "ray":
            processes, placement, init_method = _start_ray_workers(config, args, size, base)
        else:
            init_method = f"tcp://127.0.0.1:{_free_port()}"
            spawn = torch.multiprocessing.get_context("spawn")
            for rank in range(1, size):
                receive, send = spawn.Pipe(duplex=False)
                process = spawn.Process(
                    target=run_worker, name=f"rooflm-tp-rank-{rank}",
                    args=(rank, size, init_method, *args, os.getpid(),
                          logging.getLogger().getEffectiveLevel(), send))
                process.start()
                send.close()  # the worker holds the only sending end: its exit reads as EOF
                processes.append(process)
                pipes.append(receive)
        device = rank_device(base, int(os.environ.get("LOCAL_RANK", 0)))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        logger.info("tensor x pipeline parallelism: %d x %d ranks (%s)", tp_size, pp_size,
                    "nccl" if device.type == "cuda" else "gloo")
        try:
            groups = init_parallel(0, tp_size, pp_size, init_method, device, config.parallel.tp_allreduce, layers)
        except BaseException:
            _terminate(processes)
            _release_ray(processes, placement)
            watch.stop()
            raise
        return cls(groups.tp, processes, pipes, watch, groups, placement)

    def release_before_shutdown(self, release) -> None:
        """Have shutdown call release() (rank 0's ModelRunner.release_graphs) before the group
        is destroyed."""
        self._release = release

    def check_alive(self, grace_s: float = 0.0) -> None:
        """Raise WorkerDied if a worker is gone. grace_s: how long to wait for a death to show,
        after a collective failed: a killed process closes its sockets (the peer's collective
        fails at once) before its parent can reap it, and the watcher thread may not have woken
        (both seen on a loaded 2-core CI machine)."""
        self.watch.progress()  # called at every engine step: the hang dump's heartbeat
        if self.error is None:
            waitables = self._waitables()
            ready = multiprocessing.connection.wait(list(waitables), grace_s)
            failed = next((waitables[obj] for obj in ready if self._failed(obj, waitables[obj])), None)
            if failed is not None:
                self._fail(failed)
        if self.error is not None:
            with self._lock:  # the failing thread may still be stopping the other ranks: let it finish
                pass
            raise WorkerDied(self.error, self.error_rank, self.error_traceback)

    def _waitables(self) -> dict:
        """Each worker's sentinel (it exited) and open error pipe (it raised), to its process."""
        waitables = {p.sentinel: p for p in self.processes}
        waitables.update({pipe: p for p, pipe in self.error_pipes.items()
                          if pipe not in self._eof and not pipe.closed})
        return waitables

    def _failed(self, obj, process) -> bool:
        """A ready sentinel is a death; a ready pipe is a report, or EOF from a clean exit."""
        if obj is process.sentinel:
            return True
        pipe = self.error_pipes[process]
        try:
            return pipe.poll()  # data: a report waits to be read by _fail
        except (EOFError, OSError):
            return False

    def _watch(self) -> None:
        while True:
            waitables = self._waitables()
            try:
                ready = multiprocessing.connection.wait(list(waitables))
            except (OSError, ValueError):  # a handle closed under us: the executor is going away
                return
            failed = next((waitables[obj] for obj in ready if self._failed(obj, waitables[obj])), None)
            if failed is not None:
                self._fail(failed)
                return
            for obj in ready:  # pipes at EOF: the worker left without a report; its sentinel tells
                if obj is not waitables[obj].sentinel:
                    self._eof.add(obj)

    def _report(self, process):
        """The worker's WorkerError, if it sent one (the pipe keeps it after the process ends)."""
        pipe = self.error_pipes.get(process)
        if pipe is None:
            return getattr(process, "report", None)  # a Ray worker's, handed back by its actor
        if pipe.closed:
            return None
        try:
            return pipe.recv() if pipe.poll() else None
        except (EOFError, OSError):
            return None

    def _fail(self, dead) -> None:
        """Record the first worker failure, stop the other ranks and abort the device group."""
        with self._lock:
            if self._stopping or self.error is not None:
                return
            report = self._report(dead)
            if report is None:  # killed or crashed: wait for its exit code
                dead.join(JOIN_TIMEOUT_S)
                report = self._report(dead)  # it may have raised while we waited
            if report is not None:
                self.error = (f"tensor-parallel worker rank {report.rank} ({dead.name}, pid {dead.pid}) "
                              f"raised {report.summary}\n{report.traceback}")
                self.error_rank, self.error_traceback = report.rank, report.traceback
            else:
                self.error = (f"tensor-parallel worker {dead.name} (pid {dead.pid}) exited with code "
                              f"{dead.exitcode}")
                self.error_rank = self.processes.index(dead) + 1
            logger.error("%s; stopping the other ranks", self.error)
            _terminate(self.processes)
        if self.world.device_group is not self.world.host_group:
            abort_group()  # NCCL would wait for its timeout; gloo sees the closed sockets

    def shutdown(self, clean: bool = True) -> None:
        """Stop the workers: a stop message and a barrier when they are well, else terminate."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            clean = clean and self.error is None
        # A worker that never answers the stop (stuck in a step rank 0 abandoned) is terminated,
        # which ends the barrier below with an error rather than a hang.
        watchdog = threading.Timer(JOIN_TIMEOUT_S, _terminate, args=(self.processes,))
        self.watch.arm()  # a teardown that hangs prints its stacks too
        abandoned = False  # leaving the group timed out: a second try would wait the same
        try:
            if clean and self._release is not None:  # rank 0's graphs, before NCCL is asked to leave
                # (not after a failure: a collective stuck on a dead peer would hang the sync)
                self._release()
            if clean:
                watchdog.start()
                StepChannel(self.world).send_stop()
                if not destroy_group(self.world, clean=True):
                    clean, abandoned = False, True
                for process in self.processes:
                    process.join(JOIN_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a broken group: terminate below
            logger.warning("tensor-parallel shutdown: %s", exc)
            clean = False
        finally:
            watchdog.cancel()
            _terminate(self.processes)
            if not clean and not abandoned:  # a group left behind would stop this process joining another
                try:
                    destroy_group(self.world, clean=False)
                except Exception:  # noqa: BLE001
                    pass
            self.watch.stop()
            _release_ray(self.processes, self.placement_group)
            self.placement_group = None
            atexit.unregister(self.shutdown)


def _terminate(processes) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(JOIN_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join()


def _start_ray_workers(config: EngineConfig, args: tuple, size: int, base: torch.device):
    """Ranks 1..size-1 as processes placed by Ray (one bundle each, packed): (the processes, their
    placement group, the init_method: a TCP store on rank 0's cluster address)."""
    from rooflm.distributed.ray_process import (RayProcess, connect_cluster, forwarded_environment,
                                                import_ray, node_ip)
    from rooflm.engine.worker import run_ray_worker

    ray = import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    connect_cluster()
    gpu = base.type == "cuda"
    bundle = {"CPU": 1, **({"GPU": 1} if gpu else {})}
    group = placement_group([dict(bundle) for _ in range(size - 1)], strategy="PACK",
                            name="rooflm-tp-workers")
    ready, _ = ray.wait([group.ready()], timeout=RAY_PLACEMENT_TIMEOUT_S)
    if not ready:
        remove_placement_group(group)
        raise RuntimeError(f"the Ray cluster could not place {size - 1} tensor/pipeline-parallel "
                           f"workers of {bundle} within {RAY_PLACEMENT_TIMEOUT_S:.0f} s "
                           f"(resources: {ray.cluster_resources()})")
    init_method = f"tcp://{node_ip()}:{_free_port(node_ip())}"
    # A worker sees only the GPU Ray gave it: its device is cuda:0 there (LOCAL_RANK 0).
    env = {**forwarded_environment(), **({"LOCAL_RANK": "0"} if gpu else {})}
    processes = []
    try:
        for rank in range(1, size):  # placed together: each actor's start-up overlaps the others'
            strategy = PlacementGroupSchedulingStrategy(placement_group=group,
                                                        placement_group_bundle_index=rank - 1)
            process = RayProcess(f"rooflm-tp-rank-{rank}", {"num_cpus": 1, "num_gpus": bundle.get("GPU", 0),
                                                            "scheduling_strategy": strategy})
            processes.append(process)
            process.place()
        for rank, process in enumerate(processes, start=1):
            process.placed(RAY_PLACEMENT_TIMEOUT_S)
            process.start(run_ray_worker, (rank, size, init_method, *args,
                                           logging.getLogger().getEffectiveLevel()), env,
                          report_pipe=True)
            logger.info("tensor-parallel rank %d: pid %d on Ray node %s", rank, process.pid,
                        process.node_ip)
    except BaseException:
        _terminate([p for p in processes if p.pid is not None])
        _release_ray(processes, group)
        raise
    return processes, group, init_method


# How long the cluster gets to reserve the workers' bundles (a node may be starting).
RAY_PLACEMENT_TIMEOUT_S = 120.0


def _release_ray(processes, group) -> None:
    """End the Ray actors and their placement group (after their processes ended)."""
    if group is None:
        return
    for process in processes:
        process.release()
    from ray.util.placement_group import remove_placement_group
    try:
        remove_placement_group(group)
    except Exception:  # noqa: BLE001 - Ray is shutting down: the group goes with it
        pass


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
