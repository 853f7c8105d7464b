"""ROOFLM_HANG_DUMP_S=N: a tensor-parallel rank that makes no progress for N seconds prints
every thread's Python stack.

A tensor-parallel hang (a rank stuck in a collective its peers never join, a teardown that
waits on NCCL) leaves no error to read; the stacks of all ranks show where each one stopped.
faulthandler.dump_traceback_later runs on its own C-level watchdog thread, so it fires even
when the main thread is blocked inside NCCL or gloo with the GIL released. The timer is
re-armed as the rank makes progress (each step, the shutdown), so a healthy run prints
nothing; re-arming starts a thread, so it happens at most every N/4 seconds, not every step.
A rank that waits longer than N for work (an idle server's workers) prints once too: read
the stacks with that in mind. Each rank writes to its own stderr, after a line naming it.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time
from typing import Optional

import rooflm.envs as envs

ENV = "ROOFLM_HANG_DUMP_S"


def hang_dump_seconds() -> Optional[float]:
    """The period from the environment, None when unset or 0; a bad value names the variable."""
    return envs.get(ENV) or None


class HangWatch:
    """One rank's stack-dump timer; a no-op when ROOFLM_HANG_DUMP_S is unset."""

    def __init__(self, rank: int, seconds: Optional[float] = None):
        self.rank = rank
        self.seconds = hang_dump_seconds() if seconds is None else seconds
        self._armed_at = 0.0
        if self.seconds:
            print(f"rooflm: tp rank {rank} (pid {os.getpid()}) prints its stacks after {self.seconds:g} s "
                  f"without progress ({ENV})", file=sys.stderr, flush=True)
            self.arm()

    @property
    def enabled(self) -> bool:
        return bool(self.seconds)

    def arm(self) -> None:
        """(Re)start the timer: the dump comes N seconds from now unless re-armed."""
        if self.seconds:
            faulthandler.dump_traceback_later(self.seconds, repeat=False, file=sys.stderr, exit=False)
            self._armed_at = time.monotonic()

    def progress(self) -> None:
        """The rank moved on: push the dump back (cheaply: a clock read on most calls)."""
        if self.seconds and time.monotonic() - self._armed_at > self.seconds / 4:
            self.arm()

    def stop(self) -> None:
        if self.seconds:
            faulthandler.cancel_dump_traceback_later()
