"""The evaluation text and its windows of tokens, shared by `rooflm eval` and `rooflm quantize`.

Both tools cut the same text into the same windows, so the windows a default quantize calibrates
on are known to the evaluation, which refuses to score them (check_held_out). The default text is
the standard library's pydoc_data/topics.py: ~0.45 MB of English prose that ships with Python.
"""

from __future__ import annotations

import os
from typing import Optional

# The default text is cut into windows of WINDOW tokens for both uses: `rooflm eval ppl` scores
# windows from the start (or from --first-window), `rooflm quantize` (GPTQ, AWQ, FP8 KV scales)
# calibrates on CALIB_WINDOWS windows from CALIB_SKIP_WINDOWS on (its --calib-windows and
# --calib-skip-windows defaults), so every window before CALIB_SKIP_WINDOWS, and every window from
# CALIB_SKIP_WINDOWS + CALIB_WINDOWS on, is held out from a default quantize and may be scored. (A
# checkpoint quantized with a larger --calib-windows N calibrated on windows CALIB_SKIP_WINDOWS ..
# CALIB_SKIP_WINDOWS + N - 1: keep a scored range clear of those yourself; the guard knows only the
# defaults.)
WINDOW = 512
CALIB_SKIP_WINDOWS = 32
CALIB_WINDOWS = 8  # `rooflm quantize --calib-windows`'s default


def default_text_path() -> str:
    import pydoc_data.topics as topics
    return topics.__file__


def token_windows(token_ids: list[int], window: int, max_windows: Optional[int],
                  first_window: int = 0) -> list[list[int]]:
    """Non-overlapping windows of exactly `window` tokens (a ragged tail is dropped): windows
    first_window, first_window + 1, ... of the text, at most max_windows of them."""
    if window < 2:
        raise ValueError(f"window must be >= 2 tokens (one to condition on, one to score), got {window}")
    if first_window < 0:
        raise ValueError(f"the first window must be >= 0, got {first_window}")
    total = len(token_ids) // window
    if total and first_window >= total:
        raise ValueError(f"first window {first_window}: the text has {total} windows of {window} tokens "
                         f"(0..{total - 1})")
    count = total - first_window
    if max_windows is not None:
        count = min(count, max_windows)
    if count <= 0:
        raise ValueError(f"the text has {len(token_ids)} tokens, fewer than one window of {window}")
    return [token_ids[i * window:(i + 1) * window] for i in range(first_window, first_window + count)]


def check_held_out(window: int, max_windows: int, first_window: int = 0) -> None:
    """Refuse a scored range of the default text (windows first_window .. first_window + max_windows - 1
    of `window` tokens) that overlaps `rooflm quantize`'s default calibration windows (tokens
    CALIB_SKIP_WINDOWS * WINDOW .. (CALIB_SKIP_WINDOWS + CALIB_WINDOWS) * WINDOW - 1): a checkpoint
    calibrated on the tokens it is scored on would measure better than it is."""
    start, end = window * first_window, window * (first_window + max_windows)
    calib_start = CALIB_SKIP_WINDOWS * WINDOW
    calib_end = (CALIB_SKIP_WINDOWS + CALIB_WINDOWS) * WINDOW
    lo, hi = max(start, calib_start), min(end, calib_end)
    if lo < hi:
        flags = f"--max-windows {max_windows}" if first_window == 0 else \
            f"--first-window {first_window} --max-windows {max_windows}"
        raise ValueError(
            f"{flags} of {window} tokens scores tokens {start}..{end - 1} of the default text, which "
            f"overlaps tokens {lo}..{hi - 1} of the windows `rooflm quantize` calibrates on by default (windows "
            f"{CALIB_SKIP_WINDOWS}..{CALIB_SKIP_WINDOWS + CALIB_WINDOWS - 1} of {WINDOW} tokens, tokens "
            f"{calib_start}..{calib_end - 1}: --calib-skip-windows {CALIB_SKIP_WINDOWS} --calib-windows "
            f"{CALIB_WINDOWS}): score windows of {window} tokens before window {calib_start // window} or from "
            f"window {-(-calib_end // window)} on (--first-window), or pass another --text")


def read_text(path: Optional[str]) -> tuple[str, str]:
    """(text, its path); the default is pydoc_data/topics.py."""
    path = path or default_text_path()
    if not os.path.isfile(path):
        raise ValueError(f"--text {path!r} is not a file")
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read(), path
