"""Launch shapes of the batch-1 GEMV (rooflm/kernels/gemv.py) per weight shape, per GPU: the
sweep that writes rooflm/kernels/tuned/gemv.json.

Why: one config tuned on Llama-3-8B's 4096-wide shapes (DEFAULT_CONFIG) ran Phi-4-mini's
K = 3072 GEMVs at 2.4 TB/s on the H200, and K = 3840 (Gemma 3) is not a multiple of its
BLOCK_K = 1024, so every tile takes the masked path. Each shape gets the best of a grid here.

Shapes come from presets, as the decode step runs them: qkv = W @ rmsnorm(h) (the norm folded
into the load), o and down with the residual add in the epilogue, gate_up gated with the
family's activation, the LM head plain with fp32 out. Each case is a CUDA graph of the GEMV on L
different weights back to back (none served from L2), replayed between two events; bandwidth
counts weight bytes.

    python benchmarks/gemv_shapes.py --presets llama-3-8b gemma-3-12b phi-4-mini olmo-2-7b \
        --out OUT.json [--write-table]
--write-table merges the winners into rooflm/kernels/tuned/gemv.json under this GPU's name
(only where the winner beats DEFAULT_CONFIG by more than 1%; the default stays otherwise).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.gemv import time_graph  # noqa: E402  (a CUDA graph of fn, best of three)
from rooflm import envs  # noqa: E402
from rooflm.kernels.gemv import DEFAULT_CONFIG, GemvConfig, gemv  # noqa: E402
from rooflm.kernels.tuned_configs import GEMV_TABLE_PATH  # noqa: E402
from rooflm.model.presets import get_preset  # noqa: E402

CONFIGS = [GemvConfig(bn, bk, w, 2) for bn, bk, w in itertools.product((2, 4, 8), (256, 512, 1024, 2048), (4, 8))]
CONFIGS += [GemvConfig(4, 1024, 4, 3), GemvConfig(8, 512, 4, 3), GemvConfig(4, 512, 4, 3)]


def preset_shapes(name: str) -> list[dict]:
    """The four layer GEMVs and the head of one decode step: n = output rows (after gating)."""
    c = get_preset(name)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    act = "gelu_tanh" if "gelu" in c.hidden_act else "silu"
    return [dict(name="qkv", n=q + 2 * kv, k=c.hidden_size, norm=True),
            dict(name="o", n=c.hidden_size, k=q, residual=True),
            dict(name="gate_up", n=c.intermediate_size, k=c.hidden_size, norm=True, gated=True, act=act),
            dict(name="down", n=c.hidden_size, k=c.intermediate_size, residual=True),
            dict(name="head", n=c.vocab_size, k=c.hidden_size, fp32=True)]


def sweep_shape(shape: dict) -> list[dict]:
    n, k, gated = shape["n"], shape["k"], shape.get("gated", False)
    rows_w = 2 * n if gated else n
    nbytes = rows_w * k * 2
    count = max(2, min(16, (400 << 20) // nbytes))  # > 50 MB of L2 in flight, at least two copies
    ws = [torch.randn(rows_w, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(count)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(1, n, device="cuda", dtype=torch.bfloat16) if shape.get("residual") else None
    norm = torch.ones(k, device="cuda", dtype=torch.float32) if shape.get("norm") else None
    kw = dict(residual=res, norm_weight=norm, gated=gated, act=shape.get("act", "silu"),
              out_dtype=torch.float32 if shape.get("fp32") else None)
    rows = []
    for cfg in CONFIGS:
        try:
            t = time_graph(lambda: [gemv(x, w, config=cfg, **kw) for w in ws]) / count
        except Exception as e:  # a config the compiler rejects (registers, shared memory)
            rows.append({**shape, "config": cfg._asdict(), "error": str(e)[:120]})
            continue
        rows.append({**shape, "config": cfg._asdict(), "us": t * 1e6, "tb_s": nbytes / t / 1e12})
    ws.clear()
    torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--write-table", action="store_true")
    args = ap.parse_args()
    envs.put("ROOFLM_PDL", "1")  # as the engine runs them
    gpu = torch.cuda.get_device_name()
    seen, results, winners = set(), [], []
    print("| preset | GEMV | n x k | default us | TB/s | best us | TB/s | best config |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | --- |")
    for preset in args.presets:
        for shape in preset_shapes(preset):
            key = (shape["n"], shape["k"], shape.get("gated", False), shape.get("norm", False),
                   shape.get("residual", False), shape.get("fp32", False))
            if key in seen:
                continue
            seen.add(key)
            rows = [r for r in sweep_shape(shape) if "us" in r]
            results += [{**r, "preset": preset} for r in rows]
            default = next(r for r in rows if r["config"] == DEFAULT_CONFIG._asdict())
            best = min(rows, key=lambda r: r["us"])
            print(f"| {preset} | {shape['name']} | {shape['n']} x {shape['k']} | {default['us']:.1f} | "
                  f"{default['tb_s']:.2f} | {best['us']:.1f} | {best['tb_s']:.2f} | {tuple(best['config'].values())} |",
                  flush=True)
            if best["us"] < 0.99 * default["us"]:
                winners.append({"n": shape["n"], "k": shape["k"], "gated": shape.get("gated", False),
                                "config": best["config"], "us": round(best["us"], 2),
                                "default_us": round(default["us"], 2), "preset": preset, "gemv": shape["name"]})
    with open(args.out, "w") as f:
        json.dump({"gpu": gpu, "rows": results, "winners": winners}, f, indent=1)
    if args.write_table:
        table = json.load(open(GEMV_TABLE_PATH)) if os.path.exists(GEMV_TABLE_PATH) else {}
        entries = {(e["n"], e["k"], e["gated"]): e for e in table.get(gpu, {}).get("gemv", [])}
        entries.update({(e["n"], e["k"], e["gated"]): e for e in winners})
        table.setdefault(gpu, {})["gemv"] = sorted(entries.values(), key=lambda e: (e["n"], e["k"], e["gated"]))
        with open(GEMV_TABLE_PATH, "w") as f:
            json.dump(table, f, indent=1)
        print(f"wrote {len(winners)} entries for {gpu} to {GEMV_TABLE_PATH}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
