"""N-gram (prompt lookup) proposer: no model, just the sequence's own tokens.

For n from ngram_prompt_lookup_max down to ngram_prompt_lookup_min, the last n tokens of the
sequence are looked up earlier in it (prompt and output); at the most recent match the
tokens that followed it are the drafts. Copy-heavy work (editing a given text, code that
repeats its identifiers, summaries quoting their source) continues what it already holds.

Cost: scanning the whole sequence every step is O(length x n) per sequence: 94 ms a step for
64 sequences of 1280 tokens on the project's 2-core CPU, more than the GPU's verify step, so
speculation lost at batch 64 before a draft was checked. NgramIndex keeps, per sequence, a
dict from each n-gram to the end of its latest occurrence and adds only the positions that
arrived since the last step (a sequence's tokens only grow), so a step costs a few dict
operations per sequence; `lookup` is the scan, kept as the reference the tests compare with.
"""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from rooflm.spec.proposer import DeviceProposer, DraftRequest, Proposal, Proposer

# Sequences not drafted for in this many calls lose their index (rebuilt if they come back:
# preempted, or out of the batch policy's budget for a while).
STALE_CALLS = 256


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


class NgramIndex:
    """The latest end position of every n-gram (n_min..n_max) of one growing token list,
    over the positions before its last token: what `lookup` finds by scanning."""

    __slots__ = ("n_min", "n_max", "ends", "indexed", "last_call")

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.ends: dict[int, dict[tuple, int]] = {n: {} for n in range(n_min, n_max + 1)}
        self.indexed = 0  # end positions 0 .. indexed-1 are in `ends`
        self.last_call = 0

    def extend(self, tokens: list[int]) -> None:
        """Index the n-grams ending before the last token (the suffix must not find itself)."""
        stop = len(tokens) - 1
        for n, table in self.ends.items():
            first = max(self.indexed, n - 1)  # the first end a whole n-gram reaches
            if first >= stop:
                continue
            # The n-grams ending at first..stop-1 as tuples, built in C by zip over n shifted
            # slices; update() keeps the later of two equal keys, i.e. the latest occurrence.
            grams = zip(*(tokens[first + 1 - n + j:stop + 1 - n + j] for j in range(n)))
            table.update(zip(grams, range(first, stop)))
        self.indexed = max(self.indexed, stop)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        self.extend(tokens)
        length = len(tokens)
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            end = self.ends[n].get(tuple(tokens[length - n:]))
            if end is not None:
                return tokens[end + 1:end + 1 + k]
        return []


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, n_max: int, n_min: int):
        self.n_max = n_max
        self.n_min = n_min
        self._indexes: dict[int, NgramIndex] = {}  # seq_id -> its index
        self._calls = 0

    def propose(self, batch: list[DraftRequest]) -> Proposal:
        self._calls += 1
        drafts = []
        for item in batch:
            seq = item.seq
            index = self._indexes.get(seq.seq_id)
            if index is None or index.indexed > len(seq.token_ids):  # new, or not the same tokens
                index = self._indexes[seq.seq_id] = NgramIndex(self.n_min, self.n_max)
            index.last_call = self._calls
            drafts.append(index.lookup(seq.token_ids, item.num_slots))
        if self._calls % STALE_CALLS == 0:
            self._drop_stale()
        return Proposal(drafts)

    def device_proposer(self) -> "NgramDeviceProposer":
        return NgramDeviceProposer(self.n_max, self.n_min)

    def _drop_stale(self) -> None:
        oldest = self._calls - STALE_CALLS
        for seq_id in [s for s, index in self._indexes.items() if index.last_call <= oldest]:
            del self._indexes[seq_id]


class NgramDeviceProposer(DeviceProposer):
    """The same lookup over the device loop's histories: kernels/ngram_propose.py on CUDA,
    `lookup` row by row elsewhere (the CPU runs the loop eagerly)."""

    def __init__(self, n_max: int, n_min: int):
        self.n_max, self.n_min = n_max, n_min

    def propose(self, hist, lengths, drafts, num_drafts, batch: int) -> None:
        if hist.is_cuda:
            from rooflm.kernels.ngram_propose import ngram_propose
            ngram_propose(hist, lengths, drafts, num_drafts, self.n_max, self.n_min, batch)
            return
        k = drafts.shape[1]
        rows = hist[:batch].numpy()
        for b, length in enumerate(lengths[:batch].tolist()):
            found = lookup(rows[b, :length], k, self.n_max, self.n_min)
            drafts[b] = torch.tensor(found + [0] * (k - len(found)), dtype=torch.int64)
            num_drafts[b] = len(found)
