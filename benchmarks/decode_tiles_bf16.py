"""bf16 paged decode attention: (BLOCK_N, num_warps, num_stages) tiles over ShareGPT-like contexts
(hundreds of sequences of a few hundred keys, lengths spread) and long ones, one split, KV block
64 (the engine's CUDA default). Every tile is checked against the reference.

Usage (GPU): python benchmarks/decode_tiles_bf16.py [--out FILE.json]

In a ShareGPT-like run's decode steps (~400 sequences of ~400 keys) the kernel read
~2.65 TB/s, against ~2.95 at 300 x 1500; its table entry was tuned at 32 x 4096.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import kv_fp8  # noqa: E402

CONFIGS = [(128, 4, 3), (64, 4, 3), (64, 4, 4), (64, 2, 4), (64, 2, 6), (32, 4, 3), (32, 2, 4),
           (128, 8, 3), (128, 4, 4), (64, 8, 3), (128, 4, 2), (32, 4, 4)]


def shapes() -> dict[str, list[int]]:
    rng = random.Random(0)
    return {"512 x U[40,700]": [rng.randint(40, 700) for _ in range(512)],
            "400 x U[230,600]": [rng.randint(230, 600) for _ in range(400)],
            "1000 x U[230,430]": [rng.randint(230, 430) for _ in range(1000)],
            "300 x 1500": [1500] * 300,
            "32 x 4096": [4096] * 32}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    kv_fp8.BLOCK = 64
    rows = {}
    for name, lens in shapes().items():
        timed = kv_fp8.decode_sweep(lens, CONFIGS, label="bf16")
        gb = 2 * sum(lens) * kv_fp8.H_KV * kv_fp8.D * 2 / 1e9
        rows[name] = {c: {"us": us, "gbs": gb / (us * 1e-6)} for c, us in timed.items()}
        best = min(timed, key=timed.get)
        print(f"{name:<20} " + "  ".join(f"{c}: {us:7.1f} us {gb / (us * 1e-6):5.0f} GB/s" for c, us in timed.items())
              + f"\n{'':<20} best {best}", flush=True)
    print(f"\n{'config':<16}" + "".join(f"{n:>20}" for n in rows))
    for c in map(str, CONFIGS):
        print(f"{c:<16}" + "".join(f"{rows[n][c]['us']:>12.1f} {rows[n][c]['gbs']:>6.0f}" for n in rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
