"""The attention experiments on one GPU, side by side in one process.

Prefill (causal, H = 32/8, D = 128; B = 8 x S = 2048 and B = 2 x S = 8192), TFLOP/s:
  torch's FLASH and cuDNN backends on contiguous q/k/v, then rooflm's paged kernel at KV block
  sizes 16, 32, 64 and 128 (key tiles through TMA where a tile fits in a block, gathered
  otherwise), tiles as small as the block (TMA at block size 16 and 32), and Triton's automatic
  warp specialisation of the unmasked TMA loop.
Decode (one sequence of 8k, 32k and 128k keys, block sizes 16 and 64), GB/s of K/V read,
  timed as CUDA-graph replays over enough copies to miss L2: the default launch, the split kernel
  alone (the reduce launch dropped: what the second kernel costs), and other split counts and
  key tiles.
Prints one table; writes everything to --out as JSON. Usage (GPU machine, repo root):
    python benchmarks/attention_hopper.py --out DIR [--part prefill|decode|all]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import kernels as kb  # noqa: E402  (benchmarks/kernels.py: timing helpers and the torch references)

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
PREFILL_SHAPES = ((8, 2048), (2, 8192))
# (label, block_size, config or None, use_tma or None, warp_spec)
PREFILL_VARIANTS = [
    ("bs16 default (gathered)", 16, None, None, False),
    ("bs16 TMA 128x16 s3", 16, (128, 16, 4, 3), True, False),
    ("bs16 TMA 128x16 s4", 16, (128, 16, 4, 4), True, False),
    ("bs32 default", 32, None, None, False),
    ("bs32 TMA 128x32 s3", 32, (128, 32, 4, 3), True, False),
    ("bs64 default", 64, None, None, False),
    ("bs64 TMA 128x64 s3", 64, (128, 64, 4, 3), True, False),
    ("bs64 TMA 128x64 WS w4 s2", 64, (128, 64, 4, 2), True, True),
    ("bs64 TMA 128x64 WS w4 s3", 64, (128, 64, 4, 3), True, True),
    ("bs64 TMA 128x64 WS w8 s2", 64, (128, 64, 8, 2), True, True),
    ("bs128 default", 128, None, None, False),
    ("bs128 TMA 128x128 w8 s2", 128, (128, 128, 8, 2), True, False),
    ("bs128 TMA 128x128 WS w8 s2", 128, (128, 128, 8, 2), True, True),
]
DECODE_LENGTHS = (8192, 32768, 131072)


def prefill_row(batch: int, seq: int, block_size: int, config, use_tma, warp_spec: bool) -> dict:
    return kb.rooflm_prefill(batch, HEADS, KV_HEADS, seq, HEAD_DIM, torch.bfloat16, block_size, config=config,
                             use_tma=use_tma, warp_spec=warp_spec)


def run_prefill(rows: list) -> None:
    for batch, seq in PREFILL_SHAPES:
        shape = f"B={batch} S={seq}"
        ref = kb.sdpa_prefill(batch, HEADS, KV_HEADS, seq, HEAD_DIM, torch.bfloat16)
        for name in ("flash", "cudnn"):
            r = ref.get(name, {})
            rows.append({"part": "prefill", "shape": shape, "variant": "torch " + name, **r})
            print(f"prefill {shape} torch {name}: {r.get('TFLOPs', float('nan')):.0f} TFLOP/s", flush=True)
        for label, bs, config, use_tma, ws in PREFILL_VARIANTS:
            try:
                r = prefill_row(batch, seq, bs, config, use_tma, ws)
            except Exception as e:  # noqa: BLE001 - a variant may not compile here; say why
                r = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                traceback.print_exc(limit=2)
            rows.append({"part": "prefill", "shape": shape, "variant": label, **r})
            print(f"prefill {shape} {label}: {r.get('TFLOPs', float('nan')):.0f} TFLOP/s "
                  f"err {r.get('rel_error', float('nan')):.1e} {r.get('error', '')}", flush=True)
            torch.cuda.empty_cache()


def decode_row(seq: int, block_size: int, config=None, num_splits=None, drop_reduce=False) -> dict:
    import rooflm.kernels.decode_attention as da

    saved = da._decode_reduce_kernel
    if drop_reduce:
        da._decode_reduce_kernel = kb._NoLaunch()
    try:
        return kb.rooflm_decode([seq], HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, block_size, config=config,
                                num_splits=num_splits, check=not drop_reduce)
    finally:
        da._decode_reduce_kernel = saved


def run_decode(rows: list) -> None:
    from rooflm.kernels.utils import num_sms

    sms = num_sms()
    for seq in DECODE_LENGTHS:
        shape = f"1 x {seq}"
        if seq == 8192:
            r = kb.sdpa_decode([seq], HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16)
            rows.append({"part": "decode", "shape": shape, "variant": "torch sdpa (contiguous)", **r})
            print(f"decode {shape} torch sdpa: {r.get('GBps', float('nan')):.0f} GB/s", flush=True)
        variants = []
        for bs in (16, 64):
            variants += [(f"bs{bs} default", dict(block_size=bs)),
                         (f"bs{bs} split kernel alone", dict(block_size=bs, drop_reduce=True))]
        variants += [(f"bs16 splits {s}", dict(block_size=16, num_splits=s)) for s in (32, 128, sms, 2 * sms)]
        if seq == 8192:
            variants += [("bs16 splits 64 tiles 16x4w3s", dict(block_size=16, num_splits=64, config=(16, 4, 3))),
                         ("bs16 splits 64 tiles 32x2w3s", dict(block_size=16, num_splits=64, config=(32, 2, 3))),
                         ("bs16 splits 64 tiles 32x4w4s", dict(block_size=16, num_splits=64, config=(32, 4, 4))),
                         ("bs64 splits 64 tiles 64x4w3s", dict(block_size=64, num_splits=64, config=(64, 4, 3))),
                         ("bs16 splits 128 tiles 16x2w4s", dict(block_size=16, num_splits=128, config=(16, 2, 4)))]
        for label, kw in variants:
            try:
                r = decode_row(seq, **kw)
            except Exception as e:  # noqa: BLE001
                r = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                traceback.print_exc(limit=2)
            rows.append({"part": "decode", "shape": shape, "variant": label, **r})
            print(f"decode {shape} {label}: {r.get('GBps', float('nan')):.0f} GB/s "
                  f"({r.get('ms', float('nan')) * 1e3:.1f} us, splits {r.get('num_splits')}, "
                  f"config {r.get('config')}) {r.get('error', '')}", flush=True)
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--part", choices=["prefill", "decode", "all"], default="all")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ceilings = kb.measure_ceilings()
    print(f"ceilings: copy {ceilings['copy_GBps']:.0f} GB/s, bf16 matmul {ceilings['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    rows: list = []
    if args.part in ("prefill", "all"):
        run_prefill(rows)
    if args.part in ("decode", "all"):
        run_decode(rows)
    result = {"gpu": torch.cuda.get_device_name(), "commit": kb.git_commit(), "torch": torch.__version__,
              "ceilings": ceilings, "rows": rows}
    with open(os.path.join(args.out, "attention_hopper.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{'part':8s} {'shape':14s} {'variant':32s} {'value':>8s}")
    for r in rows:
        value = r.get("TFLOPs") if r["part"] == "prefill" else r.get("GBps")
        text = f"{value:8.0f}" if value is not None else f"{'error':>8s}"
        print(f"{r['part']:8s} {r['shape']:14s} {r['variant']:32s} {text}")


if __name__ == "__main__":
    main()
