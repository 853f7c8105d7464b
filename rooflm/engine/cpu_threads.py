"""Threads and OpenMP wait policy for a CPU engine on a machine it shares with other work.

torch's CPU ops (and the native decoder, rooflm/quant/native_decode.py) run in
OpenMP parallel regions of torch.get_num_threads() threads, which meet at a
barrier at the end of each. On a machine whose cores are all busy with other
work, one of those threads is often descheduled, and the others wait out a
scheduler time slice at every barrier: a decode step of a few hundred regions
took 0.6-1.2 s on 2 cores at load 6 (issue 51), against ~0.1 s quiet. Fewer
threads than cores meet at fewer barriers (one thread: none), and a passive
wait policy (OMP_WAIT_POLICY=PASSIVE) makes a waiting thread sleep instead of
spinning on the core the late thread needs.

plan_cpu_threads() decides from the number of usable cores and the load of
other work (the 1-minute load average, read before the engine runs):
  quiet       torch's defaults (a thread per core, OpenMP's spin-then-sleep);
  contended   cores minus the busy ones' worth of threads (at least 1), and a
              passive wait policy.
ROOFLM_CPU_CONTENTION (auto | on | off) overrides the decision; ROOFLM_CPU_THREADS
pins the thread count (`rooflm serve --cpu-threads`). OpenMP reads its wait
policy once, when torch loads it: the engine-core process gets it in its
environment at spawn (engine/core_process.py); an engine on a thread of an
already running process gets the thread count only. A wait policy the user set
in OMP_WAIT_POLICY is kept.

The decision is taken once, at start-up: work that starts later is not seen.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from dataclasses import dataclass
from typing import Optional

import rooflm.envs as envs

logger = logging.getLogger(__name__)

# Other work's load (runnable threads, averaged) from which the machine counts as shared:
# an idle desktop sits around 0.1-0.3.
CONTENDED_LOAD = 0.5


@dataclass(frozen=True)
class CpuThreadPlan:
    threads: Optional[int]  # None: torch's default
    passive_wait: bool
    reason: str


def plan_cpu_threads(cores: int, other_load: float, mode: str = "auto",
                     pinned: int = 0) -> CpuThreadPlan:
    """The plan for `cores` usable cores while other work keeps `other_load` of them busy."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"the CPU contention mode must be auto, on or off, got {mode!r}")
    contended = mode == "on" or (mode == "auto" and other_load >= CONTENDED_LOAD)
    if pinned > 0:
        return CpuThreadPlan(pinned, contended, f"{pinned} threads (ROOFLM_CPU_THREADS)")
    if not contended:
        why = "off" if mode == "off" else f"other load {other_load:.1f} on {cores} cores"
        return CpuThreadPlan(None, False, f"torch's defaults ({why})")
    # "on" with a quiet machine still leaves a core to the work it expects.
    other = max(other_load, 1.0) if mode == "on" else other_load
    threads = max(1, min(cores, cores - math.ceil(other - 0.25)))
    return CpuThreadPlan(threads, True, f"{threads} of {cores} cores, passive OpenMP wait: other "
                                        f"work keeps {other_load:.1f} cores busy")


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def machine_plan() -> CpuThreadPlan:
    """The plan for this machine now (the switches, the load average)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    return plan_cpu_threads(usable_cores(), load, envs.get("ROOFLM_CPU_CONTENTION"),
                            envs.get("ROOFLM_CPU_THREADS"))


def child_environment(plan: CpuThreadPlan) -> dict[str, str]:
    """What a process started now needs in its environment to follow the plan (OpenMP reads
    it when torch loads it, before any code of ours could set it)."""
    env = {}
    if plan.passive_wait and not os.environ.get("OMP_WAIT_POLICY"):
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    if plan.threads is not None:
        env["ROOFLM_CPU_THREADS"] = str(plan.threads)
    return env


_SPAWN_LOCK = threading.Lock()


@contextlib.contextmanager
def spawn_environment(env: dict[str, str]):
    """os.environ with `env` added while a child process starts (multiprocessing's spawn
    hands the child this process's environment), then as it was. One spawn at a time: data-
    parallel replicas start from threads of their own."""
    with _SPAWN_LOCK:
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def apply_threads(plan: CpuThreadPlan) -> None:
    """torch's thread count for this process (the wait policy is the environment's)."""
    if plan.threads is None:
        return
    import torch

    torch.set_num_threads(plan.threads)
    logger.info("CPU threads: %s", plan.reason)
