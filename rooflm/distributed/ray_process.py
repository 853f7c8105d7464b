"""A process on a node of a Ray cluster, with the face of a multiprocessing.Process.

Tensor/pipeline-parallel workers (engine/executor.py) and data-parallel engine cores
(dp/ray_core.py) are processes rooflm already knows how to start, watch and stop through
multiprocessing. With Ray they run on whichever node their placement-group bundle lands on:
a small actor (ProcessHost) is placed there and starts the same entry point with
multiprocessing spawn on its node, so the process is exactly the one mp would start, and
the code that watches it is unchanged:

  sentinel    a pipe of this process that becomes readable when the remote process has
              exited, or its actor or node was lost (a thread waits on the actor's wait());
  exitcode    the remote exit code; LOST_EXITCODE when the actor or its node died;
  kill/terminate, join, is_alive, pid, name.

No orphans: the remote process polls its parent (the actor) and exits when it is gone, and
Ray ends an actor when the driver that created it exits.

Ray is imported here only: without the optional extra the flags are refused earlier
(config.require_placement_backend).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import threading
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)

# The exit code reported when the actor, or the node it ran on, is gone (no exit code exists).
LOST_EXITCODE = -1001

# How long a killed actor's process gets to notice its parent is gone before join gives up.
KILL_JOIN_S = 10.0


def import_ray():
    try:
        import ray
    except ImportError as exc:
        raise RuntimeError("the ray backend needs Ray: pip install 'rooflm[ray]'") from exc
    return ray


def node_ip() -> str:
    """This host's address as the Ray cluster knows it (where remote peers reach it)."""
    return import_ray().util.get_node_ip_address()


def forwarded_environment() -> dict[str, str]:
    """rooflm's own switches (ROOFLM_*, rooflm/envs.py) as this process has them: a Ray actor's
    environment is its node's, not its driver's, so they travel with the start call."""
    return {key: value for key, value in os.environ.items() if key.startswith("ROOFLM_")}


def connect_cluster() -> None:
    """Join the Ray cluster this process belongs to (RAY_ADDRESS, or a local one started
    now), unless already connected."""
    ray = import_ray()
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)


class ProcessHost:
    """The actor: starts one process on its node and reports its end."""

    def __init__(self):
        self.process: Optional[multiprocessing.process.BaseProcess] = None
        self.reports = None  # the receiving end of the process's report pipe, if it has one

    def node(self) -> tuple[str, str]:
        """(the node's address, its Ray node id)."""
        import ray
        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def start(self, target: Callable, args: tuple, env: dict[str, str], name: str,
              report_pipe: bool = False) -> int:
        """Start target(*args) with env set in its environment from its first instruction (a
        spawned child inherits os.environ as it is at start(): OMP_* and CUDA_* are read when
        torch is imported, before the target runs); its pid. report_pipe: the sending end of a
        pipe on this node goes last in args; what the process sends there, wait() returns."""
        spawn = multiprocessing.get_context("spawn")
        send = None
        if report_pipe:
            self.reports, send = spawn.Pipe(duplex=False)
            args = (*args, send)
        self.process = spawn.Process(target=target, args=args, name=name)
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        try:
            self.process.start()
            if send is not None:
                send.close()  # the process holds the only sending end
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        return self.process.pid

    def wait(self) -> tuple[Optional[int], object]:
        """Blocks until the process exits; its exit code and its report (None if it sent none)."""
        self.process.join()
        report = None
        try:
            if self.reports is not None and self.reports.poll():
                report = self.reports.recv()
        except (EOFError, OSError):
            pass
        return self.process.exitcode, report

    def signal(self, signum: int) -> None:
        if self.process is not None and self.process.is_alive():
            os.kill(self.process.pid, signum)


class RayProcess:
    """One process placed by Ray: create() places its actor, start() starts the process."""

    def __init__(self, name: str, options: dict[str, Any]):
        """options: the actor's .options(...) (num_cpus, num_gpus, scheduling_strategy)."""
        self.name = name
        self.options = options
        self.actor = None
        self._node = None  # the actor's node() call, until placed()
        self.pid: Optional[int] = None
        self.node_ip: Optional[str] = None
        self.node_id: Optional[str] = None
        self._exitcode: Optional[int] = None
        self.report = None  # what the process sent through its report pipe before it ended
        self._exited = threading.Event()
        self._read_end, self._write_end = os.pipe()
        self._closed_pipe = False
        self._pipe_lock = threading.Lock()

    def create(self, timeout_s: float = 120.0) -> None:
        """Place the actor and wait until it is up (place() then placed())."""
        self.place()
        self.placed(timeout_s)

    def place(self) -> None:
        """Ask Ray for the actor, without waiting: several are placed at once this way."""
        ray = import_ray()
        # wait() blocks one of the actor's threads for the process's life; the others serve
        # signal() and node().
        host = ray.remote(ProcessHost).options(max_concurrency=4, **self.options)
        self.actor = host.remote()
        self._node = self.actor.node.remote()

    def placed(self, timeout_s: float = 120.0) -> None:
        """Wait until the actor is up (its bundle reserved, its worker started). Raises
        RuntimeError after timeout_s (a bundle whose node is gone may never be placed)."""
        ray = import_ray()
        try:
            self.node_ip, self.node_id = ray.get(self._node, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.kill(self.actor, no_restart=True)
            self.actor = None
            raise RuntimeError(f"{self.name}: Ray did not place its actor within {timeout_s:.0f} s "
                               f"(resources: {ray.available_resources()})") from None

    def free_port(self) -> int:
        """A port free on the actor's node now (for an address the process binds there)."""
        return import_ray().get(self.actor.free_port.remote())

    def start(self, target: Callable, args: tuple, env: Optional[dict[str, str]] = None,
              report_pipe: bool = False) -> None:
        ray = import_ray()
        self.pid = ray.get(self.actor.start.remote(target, args, dict(env or {}), self.name,
                                                   report_pipe))
        threading.Thread(target=self._wait, name=f"{self.name}-wait", daemon=True).start()

    def _wait(self) -> None:
        ray = import_ray()
        try:
            self._exitcode, self.report = ray.get(self.actor.wait.remote())
        except Exception as exc:  # noqa: BLE001 - the actor or its node died: no exit code exists
            logger.warning("%s (pid %s on %s): its Ray actor is gone: %s", self.name, self.pid,
                           self.node_ip, type(exc).__name__)
            self._exitcode = LOST_EXITCODE
        with self._pipe_lock:  # never a write after release() closed it (the number may be reused)
            if not self._closed_pipe:
                os.write(self._write_end, b"x")
        self._exited.set()

    # ---- multiprocessing.Process's face --------------------------------------------------------------

    @property
    def sentinel(self) -> int:
        return self._read_end

    @property
    def exitcode(self) -> Optional[int]:
        return self._exitcode

    def is_alive(self) -> bool:
        return self.pid is not None and not self._exited.is_set()

    def join(self, timeout: Optional[float] = None) -> None:
        if self.pid is not None:
            self._exited.wait(timeout)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the process, then end the actor (its node's resources go back to the group)."""
        self._signal(signal.SIGKILL)
        self.join(KILL_JOIN_S)
        if self.actor is not None:
            import_ray().kill(self.actor, no_restart=True)

    def _signal(self, signum: int) -> None:
        if self.actor is None or self._exited.is_set():
            return
        ray = import_ray()
        try:
            ray.get(self.actor.signal.remote(signum), timeout=KILL_JOIN_S)
        except Exception:  # noqa: BLE001 - the actor is gone: so is its process
            pass

    def release(self) -> None:
        """End the actor and close the sentinel (after the process ended)."""
        if self.actor is not None:
            try:
                import_ray().kill(self.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - Ray is shutting down: the actor goes with it
                pass
            self.actor = None
        if self.pid is not None:  # its watcher thread writes the sentinel: let it finish first
            self._exited.wait(KILL_JOIN_S)
        with self._pipe_lock:
            if self._closed_pipe:
                return
            self._closed_pipe = True
            # The numbers stay: a watcher that wakes on the closed sentinel still finds its process.
            os.close(self._read_end)
            os.close(self._write_end)
