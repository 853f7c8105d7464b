"""The engine's handle on its tensor-parallel workers: start them, watch them, stop them.

Rank 0 is the engine's own process (LLMEngine, in-process or in the engine-core process):
it schedules, runs its shard of the model and samples. Ranks 1..N-1 are worker processes
(worker.py), started here with multiprocessing spawn and joined through a TCP store on
127.0.0.1; under torchrun (RANK / WORLD_SIZE in the environment) the ranks are torchrun's
processes instead: rank 0 goes on as the engine, the others turn into workers when they build
the engine and exit when rank 0 stops them. torchrun's env:// rendezvous reaches other hosts.

A worker that dies is seen at once: a watcher thread waits on the processes' sentinels,
terminates the other workers and aborts the group, so that rank 0's collectives raise instead
of waiting; the engine then raises WorkerDied at its next step (and check_alive()), which the
engine-core process reports as EngineDead: the server answers 503, nothing is left running.
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
from rooflm.distributed.group import TPGroup, abort_group, check_divisible, destroy_group, init_group, visible_devices
from rooflm.distributed.step_broadcast import StepChannel

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 10.0


class WorkerDied(RuntimeError):
    pass


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


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


class TPExecutor:
    def __init__(self, tp: TPGroup, processes: list[multiprocessing.process.BaseProcess]):
        self.tp = tp
        self.processes = processes
        self.error: Optional[str] = None  # set when a worker died
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
        from rooflm.distributed.worker import rank_device, run_worker
        from rooflm.engine.model_runner import resolve_device

        size = config.parallel.tensor_parallel_size
        base = resolve_device(config.device.device)
        check_tensor_parallel(size, model_config, base)
        args = (config, model_config, max_model_len, model_path, load_format)
        processes = []
        if launched_by_torchrun():
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            if world != size:
                raise ValueError(f"torchrun started {world} processes but tensor_parallel_size is {size}")
            init_method = "env://"
            if rank != 0:  # this process is a worker from here on
                run_worker(rank, size, init_method, *args, parent_pid=0)
                sys.exit(0)
        else:
            init_method = f"tcp://127.0.0.1:{_free_port()}"
            spawn = torch.multiprocessing.get_context("spawn")
            for rank in range(1, size):
                process = spawn.Process(
                    target=run_worker, name=f"rooflm-tp-rank-{rank}",
                    args=(rank, size, init_method, *args, os.getpid(),
                          logging.getLogger().getEffectiveLevel()))
                process.start()
                processes.append(process)
        device = rank_device(base, int(os.environ.get("LOCAL_RANK", 0)))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        logger.info("tensor parallelism: %d ranks (%s)", size, "nccl" if device.type == "cuda" else "gloo")
        try:
            tp = init_group(0, size, init_method, device)
        except BaseException:
            _terminate(processes)
            raise
        return cls(tp, processes)

    def check_alive(self, grace_s: float = 0.0) -> None:
        """Raise WorkerDied if a worker is gone. grace_s: how long to wait for a death to show,
        after a collective failed: a killed process closes its sockets (the peer's collective
        fails at once) before its parent can reap it, and the watcher thread may not have woken
        (both seen on a loaded 2-core CI machine)."""
        if self.error is None:
            ready = multiprocessing.connection.wait([p.sentinel for p in self.processes], grace_s)
            dead = next((p for p in self.processes if p.sentinel in ready), None)
            if dead is not None:
                self._fail(dead)
        if self.error is not None:
            raise WorkerDied(self.error)

    def _watch(self) -> None:
        sentinels = {p.sentinel: p for p in self.processes}
        ready = multiprocessing.connection.wait(list(sentinels))
        self._fail(sentinels[ready[0]])

    def _fail(self, dead) -> None:
        """Record the first worker death, stop the other ranks and abort the device group."""
        with self._lock:
            if self._stopping or self.error is not None:
                return
            dead.join(JOIN_TIMEOUT_S)  # its exit code
            self.error = (f"tensor-parallel worker {dead.name} (pid {dead.pid}) exited with code "
                          f"{dead.exitcode}")
            logger.error("%s; stopping the other ranks", self.error)
            _terminate(self.processes)
        if self.tp.device_group is not self.tp.host_group:
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
        try:
            if clean:
                watchdog.start()
                StepChannel(self.tp).send_stop()
                destroy_group(self.tp, clean=True)
                for process in self.processes:
                    process.join(JOIN_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a broken group: terminate below
            logger.warning("tensor-parallel shutdown: %s", exc)
            clean = False
        finally:
            watchdog.cancel()
            _terminate(self.processes)
            if not clean:  # a group left behind would stop this process joining another one
                try:
                    destroy_group(self.tp, clean=False)
                except Exception:  # noqa: BLE001
                    pass
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
