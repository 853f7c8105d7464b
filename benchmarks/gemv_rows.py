"""A few tokens against the Llama-3-8B weights: cuBLAS (F.linear) against rooflm's multi-row
gemv (kernels/gemv.py, gemv_rows), the shape of a speculative verify forward (1 + k tokens).

Timed as benchmarks/gemv.py times batch 1: a CUDA graph calling the op on L different weights
back to back (nothing served from L2), per-call time = total / (R * L); GB/s counts the weight
bytes. Candidate (BLOCK_N, BLOCK_K, warps, stages) configs are swept; the best per shape and
the default's time are printed.

--gated times the MLP's fused gate/up instead (RMSNorm prologue, SiLU-mul epilogue, the
[2 x 14336, 4096] weight): the unfused chain (rmsnorm + cuBLAS + silu_mul) and cuBLAS alone
against gemv_rows' gated default (ROWS_CONFIG_GATED, chosen to fit shared memory, not
measured) and the candidates that fit the H100's 227 KB (tests/kernels/test_gemv.py).

    python benchmarks/gemv_rows.py [--out DIR] [--rows 2 5 8] [--gated]
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
from rooflm.kernels.gemv import (ROWS_CONFIG, ROWS_CONFIG_GATED, GemvConfig, gemv_ref,  # noqa: E402
                                 gemv_rows, pick_rows_config)
from rooflm.kernels.rmsnorm import rmsnorm  # noqa: E402
from rooflm.kernels.silu_mul import silu_mul  # noqa: E402

CANDIDATES = [GemvConfig(n, k, w, s) for n, k, w, s in itertools.product((16, 32, 64), (128, 256, 512), (4,), (3, 5))]
# Gated tiles that compile for sm_90 within 227 KB and without spills (Triton 3.9, offline):
# shared memory 144-210 KB.
GATED_CANDIDATES = [GemvConfig(*c) for c in ((32, 256, 4, 5), (32, 256, 4, 6), (32, 256, 8, 6), (32, 512, 4, 3),
                                             (64, 128, 4, 6), (16, 256, 4, 8), (32, 128, 4, 8))]


def sweep(name: str, fn_of, configs: list, layers: int) -> list:
    """(seconds per call, config, max |error|) of fn_of(cfg, weight) for each config that runs."""
    timed = []
    for cfg in configs:
        try:
            err = fn_of(cfg, 0)
            t = time_graph(lambda: [fn_of(cfg, i, timed=True) for i in range(layers)]) / layers
            timed.append((t, cfg, err))
        except Exception as exc:  # noqa: BLE001 - a config that does not compile is skipped
            print(f"{name} {tuple(cfg)}: {str(exc)[:120]}")
    return timed


def plain(args, dtype, dev) -> list[dict]:
    results = []
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, dtype=dtype, device=dev) / k ** 0.5 for _ in range(args.layers)]
        nbytes = n * k * 2
        for m in args.rows:
            x = torch.randn(m, k, dtype=dtype, device=dev)
            t = time_graph(lambda: [F.linear(x, w) for w in weights]) / args.layers
            base = {"shape": name, "m": m, "cublas_us": t * 1e6, "cublas_gb_s": nbytes / t / 1e9}
            ref = gemv_ref(x, weights[0]).float()

            def run(cfg, i, timed=False):
                y = gemv_rows(x, weights[i], config=cfg)
                return None if timed else (y.float() - ref).abs().max().item()

            default = pick_rows_config(n, k, False, dtype)
            timed = sweep(f"{name} m={m}", run, [default] + [c for c in CANDIDATES if c != default], args.layers)
            results.append(report(base, timed, nbytes, f"{name:8s} M={m}"))
    return results


def gated(args, dtype, dev) -> list[dict]:
    inter, hidden = SHAPES["gate_up"][0] // 2, SHAPES["gate_up"][1]
    weights = [torch.randn(2 * inter, hidden, dtype=dtype, device=dev) / hidden ** 0.5 for _ in range(args.layers)]
    norm_w = 1 + 0.1 * torch.randn(hidden, dtype=dtype, device=dev)
    nbytes, eps = 2 * inter * hidden * 2, 1e-5
    results = []
    for m in args.rows:
        x = torch.randn(m, hidden, dtype=dtype, device=dev)
        t_cublas = time_graph(lambda: [F.linear(x, w) for w in weights]) / args.layers
        t_chain = time_graph(lambda: [silu_mul(F.linear(rmsnorm(x, norm_w, eps), w)) for w in weights]) / args.layers
        base = {"shape": "gate_up+norm+silu", "m": m, "cublas_us": t_cublas * 1e6,
                "cublas_gb_s": nbytes / t_cublas / 1e9, "unfused_us": t_chain * 1e6}
        ref = gemv_ref(x, weights[0], norm_weight=norm_w, eps=eps, gated=True).float()

        def run(cfg, i, timed=False):
            y = gemv_rows(x, weights[i], norm_weight=norm_w, eps=eps, gated=True, config=cfg)
            return None if timed else (y.float() - ref).abs().max().item()

        configs = [ROWS_CONFIG_GATED] + [c for c in GATED_CANDIDATES if c != ROWS_CONFIG_GATED]
        results.append(report(base, sweep(f"gated m={m}", run, configs, args.layers), nbytes,
                              f"gated    M={m}  unfused {t_chain * 1e6:7.1f} us"))
    return results


def report(base: dict, timed: list, nbytes: int, label: str) -> dict:
    if not timed:
        print(f"{label}  no config ran")
        return base
    default, best = timed[0], min(timed, key=lambda r: r[0])
    row = dict(base, default_us=default[0] * 1e6, default_gb_s=nbytes / default[0] / 1e9,
               default_config=list(default[1]), best_us=best[0] * 1e6, best_gb_s=nbytes / best[0] / 1e9,
               best_config=list(best[1]), max_err=max(r[2] for r in timed),
               all={str(tuple(c)): t * 1e6 for t, c, _ in timed})
    print(f"{label}  cuBLAS {row['cublas_us']:7.1f} us {row['cublas_gb_s']:6.0f} GB/s | rows default "
          f"{row['default_us']:7.1f} us {row['default_gb_s']:6.0f} GB/s {tuple(default[1])} | best "
          f"{row['best_us']:7.1f} us {row['best_gb_s']:6.0f} GB/s {tuple(best[1])}  err {row['max_err']:.1e}",
          flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 5, 8])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--gated", action="store_true", help="the fused gate/up (norm + SiLU-mul) candidates")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dtype, dev = torch.bfloat16, "cuda"
    results = (gated if args.gated else plain)(args, dtype, dev)
    path = os.path.join(args.out, "gemv_rows_gated.json" if args.gated else "gemv_rows.json")
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows_config": list(ROWS_CONFIG),
                   "rows_config_gated": list(ROWS_CONFIG_GATED), "rows": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
