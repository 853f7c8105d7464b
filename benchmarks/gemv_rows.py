"""A few tokens against the Llama-3-8B weights: cuBLAS (F.linear) against rooflm's multi-row
gemv (kernels/gemv.py, gemv_rows), the shape of a speculative verify forward (1 + k tokens).

Timed as benchmarks/gemv.py times batch 1: a CUDA graph calling the op on L different weights
back to back (nothing served from L2), per-call time = total / (R * L); GB/s counts the weight
bytes. Candidate (BLOCK_N, BLOCK_K, warps, stages) configs are swept; the best per shape and
the default's time are printed.

    python benchmarks/gemv_rows.py [--out DIR] [--rows 2 5 8]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gemv import SHAPES, time_graph  # noqa: E402  (benchmarks/ is the script's directory)
from rooflm.kernels.gemv import ROWS_CONFIG, GemvConfig, gemv_ref, gemv_rows  # noqa: E402

CANDIDATES = [GemvConfig(n, k, w, s) for n, k, w, s in itertools.product((16, 32, 64), (128, 256, 512), (4,), (3, 5))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 5, 8])
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dtype, dev = torch.bfloat16, "cuda"
    results = []
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, dtype=dtype, device=dev) / k ** 0.5 for _ in range(args.layers)]
        nbytes = n * k * 2
        for m in args.rows:
            x = torch.randn(m, k, dtype=dtype, device=dev)
            t = time_graph(lambda: [F.linear(x, w) for w in weights]) / args.layers
            base = {"shape": name, "m": m, "cublas_us": t * 1e6, "cublas_gb_s": nbytes / t / 1e9}
            ref = gemv_ref(x, weights[0]).float()
            timed = []
            for cfg in [ROWS_CONFIG] + [c for c in CANDIDATES if c != ROWS_CONFIG]:
                try:
                    err = (gemv_rows(x, weights[0], config=cfg).float() - ref).abs().max().item()
                    t = time_graph(lambda: [gemv_rows(x, w, config=cfg) for w in weights]) / args.layers
                    timed.append((t, cfg, err))
                except Exception as exc:  # noqa: BLE001 - a config that does not compile is skipped
                    print(f"{name} m={m} {tuple(cfg)}: {str(exc)[:120]}")
            default = timed[0]
            best = min(timed, key=lambda r: r[0])
            row = dict(base, default_us=default[0] * 1e6, default_gb_s=nbytes / default[0] / 1e9,
                       best_us=best[0] * 1e6, best_gb_s=nbytes / best[0] / 1e9, best_config=list(best[1]),
                       max_err=max(r[2] for r in timed))
            results.append(row)
            print(f"{name:8s} M={m}  cuBLAS {row['cublas_us']:7.1f} us {row['cublas_gb_s']:6.0f} GB/s | rows default "
                  f"{row['default_us']:7.1f} us {row['default_gb_s']:6.0f} GB/s | best {row['best_us']:7.1f} us "
                  f"{row['best_gb_s']:6.0f} GB/s {tuple(best[1])}  err {row['max_err']:.1e}", flush=True)
    with open(os.path.join(args.out, "gemv_rows.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
