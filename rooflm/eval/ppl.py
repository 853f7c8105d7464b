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
from dataclasses import dataclass, field
from typing import Optional

# The text and its windows (default text, token_windows, the calibration windows it must not
# score): rooflm/tokenizer/text_windows.py, shared with `rooflm quantize`.


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
    first_window: int = 0  # index of the first scored window in the text
    positions: list[PositionScores] = field(default_factory=list, repr=False)

    def summary(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "positions"}


def perplexity(llm, token_windows_: list[list[int]], top_k: int = 20, model: str = "", text: str = "",
               engine: Optional[dict] = None, first_window: int = 0, progress: bool = False) -> PplResult:
    """Score every window through `llm` (an rooflm.LLM); see the module docstring. progress: a
    bar of the windows scored on stderr (a CPU run takes minutes)."""
    from rooflm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top_k)
    outputs = llm.generate(token_windows_, params, use_tqdm=progress)
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
                     first_window=first_window, positions=positions)
