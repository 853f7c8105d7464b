"""The mma.sync W4A16 kernel (rooflm/kernels/w4a16_mma.py) against the Triton W4 kernels at M <= 8.

One GPU call (< 3 min on an H100):
  1. correctness: every candidate shape of the kernel (register ring and cp.async stages, 1 or 2
     tiles, bf16 and fp16, groups 64 and 128, M 1..8, N not a multiple of 32) against
     dequantize-then-fp32 (w4a16_linear_ref);
  2. the Llama-3-8B linear shapes (and the 128256 x 4096 LM head at M = 1) at M = 1, 4, 8: the
     Triton path with its tuned tile (w4a16.pick_config) and each mma candidate, all launched with
     PDL as in decode. us per call = median CUDA-graph replay over R weight copies (>= 256 MB in
     all, so none is still in L2), GB/s of the bytes the format moves.
Writes OUT/w4_mma_sweep.json; --table merges the fastest candidate per (N, K, group, M) into
rooflm/kernels/tuned/weight_only.json under the GPU's name ("w4a16_mma": what w4a16_mma.pick_config reads).

Usage (GPU, repo root): python benchmarks/w4_mma_sweep.py --out DIR [--table]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
GROUP = 128
# (warps, depth, tiles, stages): the register ring (stages 0) and cp.async pipelines
CANDIDATES = [(4, 2, 1, 0), (8, 1, 1, 0), (4, 1, 2, 0), (8, 2, 1, 0),
              (8, 1, 1, 3), (8, 1, 1, 4), (4, 1, 1, 4), (16, 1, 1, 3),
              (4, 1, 2, 3), (4, 1, 2, 4), (8, 1, 2, 3), (2, 1, 2, 4)]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--table", nargs="?", const="", default=None,
                    help="merge the best configs into this tile table (default: rooflm's weight_only.json)")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--candidates", default=None,
                    help="'w,d,t,s;...' (warps, depth, tiles, stages) instead of CANDIDATES")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness checks")
    return ap.parse_args(argv)


def random_w4(n, k, g, dtype, seed, device):
    import torch
    gen = torch.Generator(device="cpu").manual_seed(seed)
    qw = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8).to(device)
    sc = (torch.rand(k // g, n, generator=gen) * 0.02 + 0.001).to(dtype).to(device)
    zr = torch.randint(0, 16, (k // g, n), generator=gen).float().to(dtype).to(device)
    return qw, sc, zr


def check(device) -> list:
    import torch
    from rooflm.kernels import w4a16_mma as mm
    from tests.kernels.helpers import rel_error
    from rooflm.kernels.w4a16 import w4a16_linear_ref
    rows = []
    shapes = [(48, 256, 64), (40, 1024, 128), (96, 640, 64), (6144, 4096, 128), (4096, 14336, 128)]
    configs = [mm.MmaConfig(*c) for c in [(4, 2, 1, 0), (8, 1, 2, 0), (2, 4, 1, 0), (4, 1, 1, 3), (8, 1, 2, 4), (1, 1, 2, 2)]]
    for dtype, m, (n, k, g) in itertools.product([torch.bfloat16, torch.float16], [1, 3, 8], shapes):
        qw, sc, zr = random_w4(n, k, g, dtype, 0, device)
        x = torch.randn(m, k, device=device, dtype=dtype)
        ref = w4a16_linear_ref(x, qw, sc, zr, g).float()
        for cfg, pdl in itertools.product(configs, (False, True)):
            try:
                err = float(rel_error(mm.w4a16_mma(x, qw, sc, zr, g, cfg, pdl=pdl).float(), ref))
            except Exception as e:  # noqa: BLE001 - reported as a failed row
                err = repr(e)[:300]
            rows.append(dict(dtype=str(dtype), m=m, n=n, k=k, group=g, config=cfg._asdict(), pdl=pdl, rel_err=err,
                             ok=isinstance(err, float) and err < 1e-2))
    return rows


def run(args) -> dict:
    import torch
    from quant_gemv_sweep import make_timer
    from rooflm.kernels import w4a16_mma as mm
    from rooflm.kernels.tuned_configs import device_facts
    from rooflm.kernels.w4a16 import pick_config, w4a16_bytes, w4a16_linear
    device = torch.device("cuda")
    t0 = time.time()
    checks = [] if args.no_check else check(device)
    candidates = ([tuple(int(v) for v in c.split(",")) for c in args.candidates.split(";")]
                  if args.candidates else CANDIDATES)
    bad = [r for r in checks if not r["ok"]]
    print(f"correctness: {len(checks)} checks, {len(bad)} failed ({time.time() - t0:.0f} s)", flush=True)
    for r in bad[:5]:
        print("  FAIL", r)
    timer = make_timer(True, args.replays)
    name, sms = device_facts(device)
    rows = []
    for m in [int(b) for b in args.batches.split(",")]:
        for shape in args.shapes.split(","):
            n, k = SHAPES[shape]
            if shape == "lm_head" and m > 1:
                continue
            copies = max(2, -(-256 * 2**20 // (n * k // 2)))
            ws = [random_w4(n, k, GROUP, torch.bfloat16, i, device) for i in range(copies)]
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            nbytes = w4a16_bytes(m, n, k, GROUP)
            tri = pick_config(m, n, k, GROUP, name, sms)
            us = timer([lambda w=w: w4a16_linear(x, *w, GROUP, config=tri) for w in ws])
            rows.append(dict(shape=shape, n=n, k=k, m=m, kernel="triton", config=tri._asdict(), us=us, gbs=nbytes / us / 1e3))
            for c in candidates:
                cfg = mm.MmaConfig(*c)
                try:
                    us = timer([lambda w=w: mm.w4a16_mma(x, *w, GROUP, cfg, pdl=True) for w in ws])
                except Exception as e:  # noqa: BLE001
                    print(f"  {shape} m={m} {c}: {repr(e)[:200]}")
                    continue
                rows.append(dict(shape=shape, n=n, k=k, m=m, kernel="mma", config=cfg._asdict(), us=us, gbs=nbytes / us / 1e3))
            mine = [r for r in rows if r["shape"] == shape and r["m"] == m]
            best = min((r for r in mine if r["kernel"] == "mma"), key=lambda r: r["us"])
            print(f"{shape:8s} m={m}  triton {mine[0]['us']:7.2f} us {mine[0]['gbs']:5.0f} GB/s | mma best "
                  f"{tuple(best['config'].values())} {best['us']:7.2f} us {best['gbs']:5.0f} GB/s | " +
                  " ".join(f"{tuple(r['config'].values())}:{r['us']:.1f}" for r in mine[1:]), flush=True)
            del ws
            torch.cuda.empty_cache()
    return dict(device=name, group=GROUP, checks=checks, rows=rows, seconds=time.time() - t0)


def merge_table(result: dict, path: str) -> None:
    from quant_gemv_sweep import format_table
    table = {}
    if os.path.exists(path):
        with open(path) as f:
            table = json.load(f)
    entries = table.setdefault(result["device"], {}).setdefault("w4a16_mma", [])
    for (n, k, m) in sorted({(r["n"], r["k"], r["m"]) for r in result["rows"]}):
        mine = [r for r in result["rows"] if (r["n"], r["k"], r["m"]) == (n, k, m)]
        best = min((r for r in mine if r["kernel"] == "mma"), key=lambda r: r["us"])
        tri = next(r for r in mine if r["kernel"] == "triton")
        entries[:] = [e for e in entries if not (e["n"] == n and e["k"] == k and e["m"] == m and e["group"] == result["group"])]
        entries.append(dict(n=n, k=k, m=m, group=result["group"], config=best["config"], us=round(best["us"], 2),
                            gbs=round(best["gbs"]), triton_us=round(tri["us"], 2)))
    entries.sort(key=lambda e: (e["n"], e["k"], e["group"], e["m"]))
    with open(path, "w") as f:
        f.write(format_table(table))


def main(argv=None):
    args = parse_args(argv)
    result = run(args)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "w4_mma_sweep.json"), "w") as f:
            json.dump(result, f, indent=1)
    if args.table is not None:
        from rooflm.kernels.tuned_configs import TABLE_PATH
        merge_table(result, args.table or TABLE_PATH)
    if any(not r["ok"] for r in result["checks"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
