"""Host cost of the n-gram proposer per step: the incremental index against the full scan.

    python benchmarks/spec_ngram_cost.py [--seqs 64] [--len 1280] [--steps 20]

Each step every sequence gains one token and asks for 3 drafts (n from 4 down to 2), as
`--speculative-method ngram` does at batch 64 of 1024-token prompts; the two are timed
interleaved, step by step, in one process, medians printed. Random tokens over a 32k vocabulary
rarely repeat, so both do their whole search: the worst case for the scan.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from rooflm.spec.ngram import NgramProposer, lookup  # noqa: E402
from rooflm.spec.proposer import DraftRequest  # noqa: E402


class _Seq:
    def __init__(self, seq_id: int, token_ids: list[int]):
        self.seq_id, self.token_ids = seq_id, token_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--len", type=int, default=1280)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    rng = random.Random(0)
    seqs = [_Seq(i, [rng.randrange(32000) for _ in range(args.len)]) for i in range(args.seqs)]
    proposer = NgramProposer(4, 2)
    batch = [DraftRequest(None, s, 0, 3) for s in seqs]
    t = time.perf_counter()
    proposer.propose(batch)
    build = time.perf_counter() - t
    index_s, scan_s = [], []
    for _ in range(args.steps):
        for s in seqs:
            s.token_ids.append(rng.randrange(32000))
        t = time.perf_counter()
        drafts = proposer.propose(batch).drafts
        index_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        scanned = [lookup(np.asarray(s.token_ids, dtype=np.int64), 3, 4, 2) for s in seqs]
        scan_s.append(time.perf_counter() - t)
        assert drafts == scanned
    load = os.getloadavg()[0]
    print(f"{args.seqs} sequences of ~{args.len} tokens, {args.steps} steps, 1-min load {load:.1f}")
    print(f"first call (builds the indexes): {build * 1e3:.1f} ms")
    print(f"per step: index {statistics.median(index_s) * 1e3:.2f} ms, "
          f"scan {statistics.median(scan_s) * 1e3:.1f} ms (same drafts)")


if __name__ == "__main__":
    main()
