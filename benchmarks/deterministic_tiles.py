"""Choose the deterministic matmul's tile widths per M bucket, and measure what they buy.

The persistent matmul (rooflm/kernels/matmul_persistent.py) keeps BLOCK_K, its K loop and the
dot precision fixed; BLOCK_M / BLOCK_N / warps / stages only decide which program computes which
elements. This script, on the GPU:
  1. times candidate tile shapes on the Llama-3-8B projections at M = 1 .. 2048 and checks each
     gives outputs bitwise equal to the reference shape's (a candidate that does not is never
     used);
  2. picks, per M bucket, the bitwise-equal candidate with the least total time over the
     projections, and prints the MATMUL_BUCKETS entry;
  3. with --latency, runs `rooflm bench latency` in this process, default and --deterministic,
     with those buckets in force (batch 1 128/256 and 64 x 1024/256), so the engine-level cost is
     measured in the same call as the choice.
Usage (GPU machine, repo root): python benchmarks/deterministic_tiles.py --out DIR [--latency]
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from triton.testing import do_bench

PROJECTIONS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
               "lm_head": (128256, 4096)}
REFERENCE = (128, 128, 64, 8, 8, 3)
CANDIDATES = [REFERENCE, (64, 16, 64, 1, 4, 6), (64, 32, 64, 1, 4, 4), (64, 32, 64, 1, 4, 6),
              (64, 64, 64, 8, 4, 4), (64, 64, 64, 8, 4, 6), (64, 128, 64, 8, 4, 4), (128, 64, 64, 8, 4, 4),
              (128, 128, 64, 8, 4, 4), (128, 256, 64, 8, 8, 3)]
# Bucket upper bounds and the M that stands for each (the largest in it).
BUCKETS = ((64, 64), (512, 512), (None, 2048))


def sweep() -> list[dict]:
    from rooflm.kernels.matmul_persistent import matmul_persistent
    rows = []
    ms_needed = sorted({1} | {m for _, m in BUCKETS})
    for name, (n, k) in PROJECTIONS.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        for m in ms_needed:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = matmul_persistent(x, w, config=REFERENCE)
            t_cublas = do_bench(lambda: torch.nn.functional.linear(x, w), return_mode="median")
            for cand in CANDIDATES:
                try:
                    same = bool(torch.equal(matmul_persistent(x, w, config=cand), ref))
                    t = do_bench(lambda: matmul_persistent(x, w, config=cand), return_mode="median")
                except Exception as e:  # noqa: BLE001 - a shape Triton cannot build: skip it
                    print(f"{name} M={m} {cand}: failed ({type(e).__name__}: {str(e)[:80]})")
                    continue
                rows.append(dict(shape=name, m=m, config=list(cand), ms=t, cublas_ms=t_cublas, same_sums=same))
        print(f"swept {name}", flush=True)
    return rows


def choose(rows: list[dict]) -> tuple:
    buckets = []
    for max_m, m in BUCKETS:
        best = None
        for cand in CANDIDATES:
            mine = [r for r in rows if r["m"] == m and tuple(r["config"]) == cand]
            if len(mine) != len(PROJECTIONS) or not all(r["same_sums"] for r in mine):
                continue
            total = sum(r["ms"] for r in mine)
            if best is None or total < best[0]:
                best = (total, cand)
        buckets.append((max_m, best[1]))
    # Neighbouring buckets with one config merge.
    merged = []
    for max_m, cfg in buckets:
        if merged and merged[-1][1] == cfg:
            merged[-1] = (max_m, cfg)
        else:
            merged.append((max_m, cfg))
    return tuple(merged)


def table(rows: list[dict], buckets) -> None:
    from rooflm.kernels.matmul_persistent import matmul_config
    print(f"\n{'shape':8s} {'M':>5s} {'cuBLAS':>8s} {'reference':>10s} {'chosen':>8s} {'chosen/cuBLAS':>13s}")
    for name in PROJECTIONS:
        for m in sorted({r['m'] for r in rows}):
            cfg = matmul_config(torch.bfloat16, m)
            ref = next(r for r in rows if r["shape"] == name and r["m"] == m and tuple(r["config"]) == REFERENCE)
            got = next((r for r in rows if r["shape"] == name and r["m"] == m and tuple(r["config"]) == cfg), None)
            if got:
                print(f"{name:8s} {m:5d} {ref['cublas_ms']:8.3f} {ref['ms']:10.3f} {got['ms']:8.3f} "
                      f"{got['ms'] / ref['cublas_ms']:12.2f}x")
    unequal = sorted({tuple(r["config"]) for r in rows if not r["same_sums"]})
    print(f"candidates that did not sum like the reference: {unequal or 'none'}")


_RUN = """
import sys, torch
import rooflm.kernels.matmul_persistent as mp
buckets = tuple((b, tuple(c)) for b, c in {buckets!r})
mp.check_buckets({{torch.bfloat16: buckets}})
mp.MATMUL_BUCKETS[torch.bfloat16] = mp.MATMUL_BUCKETS[torch.float16] = buckets
from rooflm.cli import main
sys.exit(main(sys.argv[1:]))
"""


def latency(out: str, buckets) -> None:
    """Each run in its own process (an 8B engine per run), the chosen buckets in force."""
    import subprocess
    import sys
    base = ["bench", "latency", "--model", "llama-3-8b", "--load-format", "dummy", "--max-model-len", "2048",
            "--num-iters-warmup", "1", "--disable-tqdm"]
    runs = {"b1": ["--batch-size", "1", "--input-len", "128", "--output-len", "256", "--num-iters", "2"],
            "b64": ["--batch-size", "64", "--input-len", "1024", "--output-len", "256", "--num-iters", "1"]}
    code = _RUN.format(buckets=[[b, list(c)] for b, c in buckets])
    for name, args in runs.items():
        for mode in ("default", "deterministic"):
            path = os.path.join(out, f"tiles-{name}-{mode}.json")
            extra = ["--deterministic"] if mode == "deterministic" else []
            subprocess.run([sys.executable, "-c", code] + base + args + extra + ["--output-json", path],
                           stdout=subprocess.DEVNULL, check=False)
    print("\n| run | default TPOT ms | deterministic TPOT ms | cost |\n| --- | ---: | ---: | ---: |")
    for name in runs:
        try:
            a, b = (json.load(open(os.path.join(out, f"tiles-{name}-{m}.json")))["tpot_ms"]["median"]
                    for m in ("default", "deterministic"))
        except (OSError, KeyError, ValueError) as e:
            print(f"| {name} | missing ({e}) | | |")
            continue
        print(f"| {name} | {a:.2f} | {b:.2f} | {b / a - 1:+.1%} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--latency", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from rooflm.kernels import matmul_persistent as mp
    rows = sweep()
    buckets = choose(rows)
    mp.check_buckets({torch.bfloat16: buckets})
    # In force for this process only: what the table in matmul_persistent.py should say.
    mp.MATMUL_BUCKETS[torch.bfloat16] = mp.MATMUL_BUCKETS[torch.float16] = buckets
    print(f"chosen bf16/fp16 buckets: {buckets}")
    table(rows, buckets)
    with open(os.path.join(args.out, "tiles.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "buckets": [[b, list(c)] for b, c in buckets],
                   "rows": rows}, f, indent=1)
    if args.latency:
        latency(args.out, buckets)


if __name__ == "__main__":
    main()
