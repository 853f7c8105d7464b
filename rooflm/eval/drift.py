"""How far one run's next-token distributions are from another's on the same text
(`rooflm eval drift A.json B.json`): two precisions, two KV-cache formats, two kernels.

Position by position, over the scored tokens of two `rooflm eval ppl` runs of the same windows:

* perplexity of each, and B's change relative to A;
* top-1 agreement: the share of positions where both put the same token first;
* mean |delta logprob| of the actual next token;
* KL(A || B), a lower bound: each run stored only its top-k tokens, so the distributions are
  compared on the tokens both runs list plus one bucket for all other tokens. Merging outcomes
  never increases KL (the data-processing inequality), so the figure is <= the true KL, and equal
  when both distributions put almost all their mass on the shared tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_FLOOR = 1e-12  # keeps log() finite when a bucket's remaining mass rounds to zero


@dataclass(frozen=True)
class Drift:
    num_positions: int
    ppl_a: float
    ppl_b: float
    ppl_change: float  # (ppl_b - ppl_a) / ppl_a
    top1_agreement: float
    mean_abs_logprob_delta: float
    mean_kl_lower_bound: float  # nats


def kl_lower_bound(top_a: dict[int, float], top_b: dict[int, float]) -> float:
    """KL(A || B) over the tokens both list, plus one bucket for everything else (see above)."""
    shared = top_a.keys() & top_b.keys()
    kl = 0.0
    pa_rest, pb_rest = 1.0, 1.0
    for t in shared:
        pa, pb = math.exp(top_a[t]), math.exp(top_b[t])
        kl += pa * (top_a[t] - top_b[t])
        pa_rest -= pa
        pb_rest -= pb
    pa_rest, pb_rest = max(pa_rest, _FLOOR), max(pb_rest, _FLOOR)
    return max(kl + pa_rest * math.log(pa_rest / pb_rest), 0.0)


def compare(a: dict, b: dict) -> Drift:
    """a, b: the JSON of two `rooflm eval ppl` runs (with positions) over the same windows."""
    for key in ("window", "num_windows", "num_scored"):
        if a[key] != b[key]:
            raise ValueError(f"the runs scored different windows: {key} {a[key]} vs {b[key]}")
    if a.get("first_window", 0) != b.get("first_window", 0):  # absent from results before --first-window
        raise ValueError(f"the runs scored different windows: first_window {a.get('first_window', 0)} vs "
                         f"{b.get('first_window', 0)}")
    pa, pb = a["positions"], b["positions"]
    agree = sum(1 for x, y in zip(pa, pb) if max(x["top"], key=x["top"].get) == max(y["top"], key=y["top"].get))
    delta = sum(abs(x["logprob"] - y["logprob"]) for x, y in zip(pa, pb))
    kl = sum(kl_lower_bound(_ids(x["top"]), _ids(y["top"])) for x, y in zip(pa, pb))
    n = len(pa)
    return Drift(num_positions=n, ppl_a=a["ppl"], ppl_b=b["ppl"], ppl_change=(b["ppl"] - a["ppl"]) / a["ppl"],
                 top1_agreement=agree / n, mean_abs_logprob_delta=delta / n, mean_kl_lower_bound=kl / n)


def _ids(top: dict) -> dict[int, float]:
    # JSON object keys are strings.
    return {int(t): lp for t, lp in top.items()}
