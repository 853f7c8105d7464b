"""What the device n-gram proposer (rooflm/kernels/ngram_propose.py) costs as histories grow: a
history that repeats (a match in the last tile: one tile scanned) against one with no repeat at
all (every n scans the whole history), batch 1 and 16, k = 4, n 4..1.

    python benchmarks/ngram_scan.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from rooflm.kernels.ngram_propose import ngram_propose  # noqa: E402


def main() -> None:
    print("| batch | history | repeats: us | no repeat: us |")
    print("| ---: | ---: | ---: | ---: |")
    for batch in (1, 16):
        for length in (1024, 16384, 131072):
            lengths = torch.full((batch,), length, dtype=torch.int64, device="cuda")
            drafts = torch.empty(batch, 4, dtype=torch.int64, device="cuda")
            count = torch.empty(batch, dtype=torch.int64, device="cuda")
            times = []
            for repeats in (True, False):
                if repeats:  # a period of 97 tokens: the suffix recurs 97 tokens back
                    hist = (torch.arange(length, device="cuda") % 97).to(torch.int32).repeat(batch, 1)
                else:  # all distinct: nothing matches, not even one token
                    hist = torch.arange(length, device="cuda", dtype=torch.int32).repeat(batch, 1)
                fn = lambda: ngram_propose(hist, lengths, drafts, count, 4, 1)  # noqa: E731
                fn()
                assert (count > 0).all() if repeats else (count == 0).all()
                times.append(triton.testing.do_bench(fn, warmup=20, rep=200, return_mode="median") * 1e3)
            print(f"| {batch} | {length} | {times[0]:.1f} | {times[1]:.1f} |")


if __name__ == "__main__":
    main()
