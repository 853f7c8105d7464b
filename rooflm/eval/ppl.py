"""Perplexity of a model on a text, through the engine itself (`rooflm eval ppl`).

The text is tokenized once and cut into non-overlapping windows of `window` tokens; each window
is one request whose prompt logprobs (the engine's own prefill, the same path that serves) give
log p(token_i | tokens before it in the window) for every token but the first. Perplexity is
exp(mean negative log-likelihood) over all scored tokens:

    ppl = exp(-(1 / N) * sum_windows sum_{i >= 1} log p(t_i | t_0 .. t_{i-1}))

Each position also keeps its top-k tokens and their logprobs, so two runs (two precisions, two
KV-cache formats) can be compared position by position (eval/drift.py). The default text is the
standard library's pydoc_data/topics.py: ~0.45 MB of English prose that ships with Python, so
the figure is reproducible on any machine without a download.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Optional

# The default text is cut into windows of WINDOW tokens for both uses: `rooflm eval ppl` scores
# windows from the start, `rooflm quantize` (GPTQ, AWQ, FP8 KV scales) calibrates on windows from
# CALIB_SKIP_WINDOWS on (its --calib-skip-windows default), so every window before that one is
# held out and may be scored.
WINDOW = 512
CALIB_SKIP_WINDOWS = 32


def default_text_path() -> str:
    import pydoc_data.topics as topics
    return topics.__file__


@dataclass
class PositionScores:
    """What a run saw at one scored position: the actual token's logprob and the top-k."""

    logprob: float
    top: dict[int, float]  # token id -> logprob, the k most likely


@dataclass
class PplResult:
    model: str
    text: str
    window: int
    num_windows: int
    num_scored: int
    nll: float  # mean negative log-likelihood, nats per token
    ppl: float
    engine: dict
    positions: list[PositionScores] = field(default_factory=list, repr=False)

    def summary(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "positions"}


def token_windows(token_ids: list[int], window: int, max_windows: Optional[int]) -> list[list[int]]:
    """Non-overlapping windows of exactly `window` tokens (a ragged tail is dropped)."""
    if window < 2:
        raise ValueError(f"window must be >= 2 tokens (one to condition on, one to score), got {window}")
    count = len(token_ids) // window
    if max_windows is not None:
        count = min(count, max_windows)
    if count == 0:
        raise ValueError(f"the text has {len(token_ids)} tokens, fewer than one window of {window}")
    return [token_ids[i * window:(i + 1) * window] for i in range(count)]


def check_held_out(window: int, max_windows: int) -> None:
    """Refuse a scored range of the default text that reaches `rooflm quantize`'s default
    calibration windows (tokens CALIB_SKIP_WINDOWS * WINDOW on): a checkpoint calibrated on the
    tokens it is scored on would measure better than it is."""
    end = window * max_windows
    calib_start = CALIB_SKIP_WINDOWS * WINDOW
    if end > calib_start:
        raise ValueError(
            f"--max-windows {max_windows} of {window} tokens scores tokens 0..{end - 1} of the default text, which "
            f"overlaps tokens {calib_start}..{end - 1} of the windows `rooflm quantize` calibrates on (window "
            f"{CALIB_SKIP_WINDOWS} of {WINDOW} tokens on, --calib-skip-windows): score at most "
            f"{calib_start // window} windows of {window}, or pass another --text")


def perplexity(llm, token_windows_: list[list[int]], top_k: int = 20, model: str = "", text: str = "",
               engine: Optional[dict] = None) -> PplResult:
    """Score every window through `llm` (an rooflm.LLM); see the module docstring."""
    from rooflm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top_k)
    outputs = llm.generate(token_windows_, params, use_tqdm=False)
    positions: list[PositionScores] = []
    for window, out in zip(token_windows_, outputs):
        entries = out.prompt_logprobs
        if entries is None or len(entries) != len(window):
            raise RuntimeError(f"expected {len(window)} prompt logprob entries, got "
                               f"{None if entries is None else len(entries)}")
        for token, entry in zip(window[1:], entries[1:]):
            top = {t: lp.logprob for t, lp in entry.items() if lp.rank is not None and lp.rank <= top_k}
            positions.append(PositionScores(entry[token].logprob, top))
    nll = -sum(p.logprob for p in positions) / len(positions)
    return PplResult(model=model, text=text, window=len(token_windows_[0]), num_windows=len(token_windows_),
                     num_scored=len(positions), nll=nll, ppl=math.exp(nll), engine=engine or {},
                     positions=positions)


def read_text(path: Optional[str]) -> tuple[str, str]:
    """(text, its path); the default is pydoc_data/topics.py."""
    path = path or default_text_path()
    if not os.path.isfile(path):
        raise ValueError(f"--text {path!r} is not a file")
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read(), path
