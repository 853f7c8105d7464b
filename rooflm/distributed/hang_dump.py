"""ROOFLM_HANG_DUMP_S=N: every rank prints every thread's Python stack after N seconds.

A tensor-parallel hang (a rank stuck in a collective its peers never join, a teardown that
waits on NCCL) leaves no error to read; the stacks of all ranks show where each one stopped.
faulthandler.dump_traceback_later runs on its own C-level watchdog thread, so it fires even
when the main thread is blocked inside NCCL or gloo with the GIL released. With repeat the
dump comes every N seconds until the process ends (a slow run prints several; a hang keeps
printing). Each rank writes to its own stderr, labelled with its rank first.
"""

from __future__ import annotations

import faulthandler
import os
import sys

ENV = "ROOFLM_HANG_DUMP_S"


def hang_dump_seconds() -> float | None:
    """The period from the environment, None when unset or 0; a bad value names the variable."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{ENV} must be a number of seconds, got {raw!r}") from None
    if seconds < 0:
        raise ValueError(f"{ENV} must be >= 0 seconds, got {raw!r}")
    return seconds or None


def arm_hang_dump(rank: int) -> bool:
    """Arm the dump on this process when ROOFLM_HANG_DUMP_S is set; True if armed."""
    seconds = hang_dump_seconds()
    if seconds is None:
        return False
    print(f"rooflm: tp rank {rank} (pid {os.getpid()}) dumps its stacks every {seconds:g} s "
          f"({ENV})", file=sys.stderr, flush=True)
    faulthandler.dump_traceback_later(seconds, repeat=True, file=sys.stderr, exit=False)
    return True


def disarm_hang_dump() -> None:
    faulthandler.cancel_dump_traceback_later()
