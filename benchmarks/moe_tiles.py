"""Tiles of the fused MoE (rooflm/kernels/fused_moe.py) per layer shape and batch, per GPU: the
sweep that writes rooflm/kernels/tuned/fused_moe.json (issue 48's per-GPU tile tables).

For each batch: every block_m that fits the expected rows per expert, gate_up's tile searched
with down's at the default, then down's with gate_up's best (the two GEMMs share only block_m).
Timed as benchmarks/moe_kernel.py times the fused path: a CUDA graph over L layers' different
weights (no expert served from L2), routing = top-k of random logits.

    python benchmarks/moe_tiles.py --shape qwen3-30b-a3b --out OUT.json [--batches 1,4,...] [--write-table]
--write-table replaces this shape's entries in fused_moe.json under this GPU's name with every
swept batch's winner (default_config where nothing beat it).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.moe_kernel import SHAPES, routing, time_graph  # noqa: E402
from rooflm.kernels.fused_moe import TABLE_PATH, FusedMoeConfig, GemmTile, default_config, fused_moe  # noqa: E402
from rooflm.kernels.tuned_configs import device_facts  # noqa: E402

TILES = [GemmTile(bn, bk, 1 if bn <= 64 else 8, w, s)
         for bn, bk, w, s in itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (3, 4))
         if not (bk == 256 and bn == 128)]


def block_ms(num_tokens: int, num_experts: int, top_k: int) -> list[int]:
    per_expert = num_tokens * top_k / num_experts
    return [bm for bm in (16, 32, 64, 128) if bm <= max(16, 4 * per_expert)]


def timer(x, weights, ids, w13s, w2s):
    def run(cfg: FusedMoeConfig) -> float:
        try:
            return time_graph(lambda: [fused_moe(x, a, b, weights, ids, config=cfg) for a, b in zip(w13s, w2s)],
                              reps=10) / len(w13s)
        except Exception:  # a tile the compiler rejects (shared memory, registers)
            return float("inf")
    return run


def tune_batch(shape: dict, t: int, w13s, w2s, gen) -> dict:
    e, k, h, i = shape["num_experts"], shape["top_k"], shape["hidden"], shape["inter"]
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    weights, ids = routing(t, e, k, gen)
    run = timer(x, weights, ids, w13s, w2s)
    default = default_config(t, e, k, h, i, device_facts(x.device)[1])
    best_cfg, best_s = default, run(default)
    default_s = best_s
    for bm in block_ms(t, e, k):
        for tile in TILES:
            cfg = FusedMoeConfig(bm, tile, best_cfg.down if bm == best_cfg.block_m else default.down)
            s = run(cfg)
            if s < best_s:
                best_cfg, best_s = cfg, s
    for tile in TILES:
        cfg = dataclasses.replace(best_cfg, down=tile)
        s = run(cfg)
        if s < best_s:
            best_cfg, best_s = cfg, s
    return {"e": e, "top_k": k, "h": h, "i": i, "m": t, "config": best_cfg.to_dict(),
            "us": round(best_s * 1e6, 2), "default_us": round(default_s * 1e6, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128,256,512,1024")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", required=True)
    ap.add_argument("--write-table", action="store_true")
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    e, h, i = shape["num_experts"], shape["hidden"], shape["inter"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13s = [torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
            for _ in range(args.layers)]
    w2s = [torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02 for _ in range(args.layers)]
    gpu = torch.cuda.get_device_name()
    rows = []
    print(f"| {args.shape} batch | default us | tuned us | speed-up | config |\n| ---: | ---: | ---: | ---: | --- |")
    for t in map(int, args.batches.split(",")):
        r = tune_batch(shape, t, w13s, w2s, gen)
        rows.append(r)
        print(f"| {t} | {r['default_us']:.1f} | {r['us']:.1f} | {r['default_us'] / r['us']:.2f}x | {r['config']} |",
              flush=True)
    with open(args.out, "w") as f:
        json.dump({"gpu": gpu, "shape": args.shape, "rows": rows}, f, indent=1)
    if args.write_table:
        table = json.load(open(TABLE_PATH)) if os.path.exists(TABLE_PATH) else {}
        keep = rows  # every swept batch: a batch between tabled ones takes the next one up's tiles
        old = [r for r in table.get(gpu, {}).get("fused_moe", [])
               if (r["e"], r["top_k"], r["h"], r["i"]) != (e, shape["top_k"], h, i)]
        table.setdefault(gpu, {})["fused_moe"] = old + keep
        with open(TABLE_PATH, "w") as f:
            json.dump(table, f, indent=1)
        print(f"wrote {len(keep)} entries for {gpu} to {TABLE_PATH}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
