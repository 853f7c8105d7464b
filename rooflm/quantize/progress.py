"""A progress bar on stderr for the per-layer loops: GPTQ and AWQ take minutes on a CPU."""

from __future__ import annotations

import sys


def progress_bar(total: int, desc: str, unit: str = "linear"):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, mininterval=1.0, dynamic_ncols=True)
