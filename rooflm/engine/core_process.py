"""The engine core as the API process holds it: its OS process, its two sockets, and its face.

launch() starts the core (core.py) with multiprocessing's 'spawn' (a fresh
interpreter: no copied CUDA context, threads or locks), loads the tokenizer
here while the core loads the model, and waits for EngineReady. The handle is
then the engine's face for the server, as an LLMEngine is in-process:
  info       the EngineInfo the core sent at start-up;
  tokenizer  this process's own (the same rule as the engine's), for prompts,
             chat templates, echo and logprob token text;
  observers  called with each StepReport the core ships (the StepMeter behind
             the Prometheus step gauges and the log line).
EngineCoreClient (core_client.py) does the talking over the sockets.

The sockets are ipc:// files in a private temporary directory (mode 0700, so
only this user can connect), removed by close().

restart() replaces a core that died with a fresh one built from the same
configuration, environment and tokenizer, in place: the server's references to
this handle (its info, tokenizer, observers) stay valid across it.

No orphans: the core polls this process's pid and exits when it is gone
(core.py); close() ends it from here (Shutdown, a wait, then SIGKILL: the core
ignores SIGTERM), and an atexit hook calls close() for exits that skip it.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import shutil
import tempfile
import time
from typing import Callable, Optional

import msgspec
import zmq

import rooflm.envs as envs
from rooflm.config import EngineConfig
from rooflm.engine.core import run_engine_core
from rooflm.engine.frame_auth import FrameAuth
from rooflm.engine.cpu_threads import child_environment, machine_plan, spawn_environment
from rooflm.engine.core_protocol import (CoreState, EngineDead, EngineReady, Shutdown, encoder,
                                         output_decoder)
from rooflm.engine.report import EngineInfo, StepReport

logger = logging.getLogger(__name__)

# How often launch() checks that the core is still alive while it loads the model.
READY_POLL_S = 0.5

# How long close() gives the core to exit on its own before it kills it.
EXIT_TIMEOUT_S = 10.0


class EngineStartError(RuntimeError):
    """The engine core could not be built (its error), or exited before it was ready."""


class EngineCoreProcess:
    def __init__(self, process: multiprocessing.process.BaseProcess, context: zmq.Context,
                 input_socket: zmq.Socket, output_socket: zmq.Socket, socket_dir: Optional[str],
                 frames: Optional[FrameAuth] = None):
        self.process = process
        self.context = context
        self.input_socket = input_socket  # PUSH, connected: the API process writes
        self.output_socket = output_socket  # PULL, bound: the API process reads
        self.socket_dir = socket_dir  # None: tcp:// sockets (a core on another node)
        # HMAC on every frame where the sockets are tcp:// (frame_auth.py); a pass-through on ipc://.
        self.frames = frames or FrameAuth(None)
        self.info: Optional[EngineInfo] = None
        self.tokenizer = None
        self.ready_state: Optional[CoreState] = None  # the core's state at EngineReady
        self.observers: list[Callable[[StepReport], None]] = []
        self._closed = False
        # What launch() was given, for restart(): (config, env).
        self._launch_args: Optional[tuple[EngineConfig, dict[str, str]]] = None

    @classmethod
    def launch(cls, config: EngineConfig, env: Optional[dict[str, str]] = None,
               tokenizer=None) -> "EngineCoreProcess":
        """Start the core and wait until its engine is built. Raises EngineStartError.

        env: variables the core sets before it builds the engine (a data-parallel replica's
        CUDA_VISIBLE_DEVICES); tokenizer: one already loaded (the replicas share one)."""
        core = cls._spawn(config, env)
        try:
            core.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config)
            core._become_ready()
        except BaseException:
            core.close(timeout=0)
            raise
        return core

    def restart(self) -> None:
        """Replace a core that died (or is to be dropped) with a fresh one of the same
        configuration; blocks until it is ready. Raises EngineStartError, leaving this handle
        closed. The caller stops using the sockets first: they are replaced."""
        old_pid = self.process.pid
        self.close(timeout=0)
        fresh = self._spawn_again()
        # Take over the fresh process's resources: this object is the one the server holds.
        self.process, self.context = fresh.process, fresh.context
        self.input_socket, self.output_socket = fresh.input_socket, fresh.output_socket
        self.socket_dir, self.frames, self._closed = fresh.socket_dir, fresh.frames, False
        atexit.unregister(fresh.close)
        atexit.register(self.close)
        try:
            self._become_ready()
        except BaseException:
            self.close(timeout=0)
            raise
        logger.warning("engine core restarted: pid %d replaces pid %s", self.process.pid, old_pid)

    def _spawn_again(self) -> "EngineCoreProcess":
        """A fresh core where this one ran (restart)."""
        return type(self)._spawn(*self._launch_args)

    @classmethod
    def _spawn(cls, config: EngineConfig, env: Optional[dict[str, str]]) -> "EngineCoreProcess":
        """The core's process started and its sockets open; not yet ready."""
        socket_dir = tempfile.mkdtemp(prefix="rooflm-core-")
        input_address = f"ipc://{socket_dir}/input"
        output_address = f"ipc://{socket_dir}/output"
        context = zmq.Context()
        # Each side binds what it reads and connects what it writes: a connected writer
        # queues from the first message on, so nothing waits for the peer's handshake.
        output_socket = context.socket(zmq.PULL)
        output_socket.bind(output_address)
        input_socket = context.socket(zmq.PUSH)
        input_socket.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a send
        input_socket.connect(input_address)
        spawn = multiprocessing.get_context("spawn")
        process = spawn.Process(
            target=_run_engine_core_in, name="rooflm-engine-core",
            args=(env or {}, msgspec.msgpack.encode(config), input_address, output_address,
                  multiprocessing.current_process().pid, logging.getLogger().getEffectiveLevel(),
                  logging.getLogger("rooflm").getEffectiveLevel()))
        core = cls(process, context, input_socket, output_socket, socket_dir)
        core._launch_args = (config, dict(env or {}))
        with spawn_environment(_cpu_environment(config)):
            process.start()
        atexit.register(core.close)
        return core

    def _become_ready(self) -> None:
        ready = self._wait_ready()
        self.info, self.ready_state = ready.info, ready.state
        logger.info("engine core ready (pid %d): %s on %s, %d KV blocks", self.process.pid,
                    self.info.model, self.info.device, self.info.num_blocks)

    def _wait_ready(self) -> EngineReady:
        decode = output_decoder().decode
        poller = zmq.Poller()
        poller.register(self.output_socket, zmq.POLLIN)
        while True:
            if poller.poll(int(READY_POLL_S * 1000)):
                frame = self.frames.open(self.output_socket.recv())
                if frame is None:
                    continue  # not from the core: dropped and counted
                message = decode(frame)
                if isinstance(message, EngineReady):
                    return message
                if isinstance(message, EngineDead):
                    raise EngineStartError(f"the engine could not start: {message.error}")
            elif not self.process.is_alive():
                raise EngineStartError(f"the engine core exited with code {self.process.exitcode} "
                                       f"before it was ready")

    # ---- the face ------------------------------------------------------------------------------------

    def add_observer(self, observer: Callable[[StepReport], None]) -> None:
        """Call observer(report) for each step the core reports, on the event loop."""
        self.observers.append(observer)

    def remove_observer(self, observer: Callable[[StepReport], None]) -> None:
        self.observers.remove(observer)

    # ---- the process ---------------------------------------------------------------------------------

    @property
    def sentinel(self) -> int:
        """A file descriptor that becomes readable when the core process has exited."""
        return self.process.sentinel

    @property
    def exitcode(self) -> Optional[int]:
        return self.process.exitcode

    def join(self, timeout: float) -> None:
        self.process.join(timeout)

    def close(self, timeout: float = EXIT_TIMEOUT_S) -> None:
        """End the core (told to shut down, it has `timeout` seconds to exit), free the sockets.

        Idempotent. The client sends Shutdown first when it stops; this sends one too, for the
        exits that skip the client (start-up failed, the process is exiting)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self.process.pid is not None:
            if self.process.is_alive() and timeout > 0:
                try:
                    self.input_socket.send(self.frames.seal(encoder().encode(Shutdown())), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # unreachable: it is killed below
            self.process.join(timeout)
            if self.process.is_alive():
                if timeout > 0:
                    logger.warning("the engine core (pid %d) did not exit in %.0f s; killing it",
                                   self.process.pid, timeout)
                self.process.kill()
                self.process.join(EXIT_TIMEOUT_S)
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        self.context.term()
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)


def _run_engine_core_in(env: dict[str, str], *args) -> None:
    """The core's entry point: set its environment first (CUDA reads CUDA_VISIBLE_DEVICES
    when it starts, which is later, when the engine is built)."""
    import os
    os.environ.update(env)
    pinned = envs.get("ROOFLM_CPU_THREADS")
    if pinned > 0:
        import torch
        torch.set_num_threads(pinned)
    run_engine_core(*args)


def _cpu_environment(config: EngineConfig) -> dict[str, str]:
    """A CPU core's threads and OpenMP wait policy for this machine now (cpu_threads.py)."""
    device = config.device.device
    if device != "cpu":
        import torch
        if device != "auto" or torch.cuda.is_available():
            return {}
    plan = machine_plan()
    logger.info("engine core CPU threads: %s", plan.reason)
    return child_environment(plan)


def load_tokenizer(config: EngineConfig):
    from rooflm.model.loader import resolve_model
    from rooflm.tokenizer.tokenizer import load_model_tokenizer

    started = time.perf_counter()
    model_path, load_format = resolve_model(config.load.model, config.load.load_format,
                                            revision=config.load.revision,
                                            download_dir=config.load.download_dir)
    tokenizer = load_model_tokenizer(config.load.tokenizer, model_path, load_format,
                                     download_dir=config.load.download_dir)
    logger.debug("API process: tokenizer loaded in %.2f s", time.perf_counter() - started)
    return tokenizer
