"""N-gram (prompt lookup) proposer: no model, just the sequence's own tokens.

For n from ngram_prompt_lookup_max down to ngram_prompt_lookup_min, the last n tokens of the
sequence are looked up earlier in it (prompt and output); at the most recent match the
tokens that followed it are the drafts. Copy-heavy work (editing a given text, code that
repeats its identifiers, summaries quoting their source) continues what it already holds.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from rooflm.spec.proposer import DraftRequest, Proposal, Proposer


def lookup(tokens: np.ndarray, k: int, n_max: int, n_min: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix
    (n_max down to n_min tokens) of `tokens`; [] if none occurred."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n:]
        # Windows that start before the suffix itself: start i covers tokens[i:i + n].
        windows = sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, n_max: int, n_min: int):
        self.n_max = n_max
        self.n_min = n_min

    def propose(self, batch: list[DraftRequest]) -> Proposal:
        drafts = []
        for item in batch:
            tokens = np.asarray(item.seq.token_ids, dtype=np.int64)
            drafts.append(lookup(tokens, item.num_slots, self.n_max, self.n_min))
        return Proposal(drafts)
