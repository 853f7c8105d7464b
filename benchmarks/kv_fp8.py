"""Paged decode and prefill attention with a bf16 cache against FP8 (E4M3) caches, with a scale
per token and KV head (fp8) and with static per-head scales (fp8s), same shapes, same call: time,
and GB/s of K/V bytes each format must read.

Usage (GPU): python benchmarks/kv_fp8.py [--out DIR] [--block-size 16] [--sweep-per-token]
            [--mma-configs "4,2,1;8,2,1"] [--mma-only]

Static FP8 (fp8s) runs on the CUDA kernel (kernels/fp8_decode_mma.py); "fp8s tri" is the Triton
kernel it replaces, same shapes and call.

Decode reads every visible key once: bytes = 2 * keys * H_kv * D * e, with e = 2 for bf16,
1 + 4 / D for per-token FP8 (the scales) and 1 for static FP8. At equal GB/s the FP8 kernel takes
half the time; the table says how close it comes. Prefill is compute-bound: FP8 should cost
nothing there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from rooflm.kernels.decode_attention import decode_attention, decode_attention_ref  # noqa: E402
from rooflm.kernels.fp8_decode_mma import Fp8DecodeConfig  # noqa: E402
from rooflm.kernels.prefill_attention import prefill_attention, prefill_flops  # noqa: E402
from tests.kernels.helpers import random_paged_batch  # noqa: E402
from rooflm.kernels.fp8_quant import FP8_MAX  # noqa: E402
from rooflm.kernels.paged_attention_ref import quantize_fp8_ref, quantize_fp8_static_ref  # noqa: E402

H, H_KV, D = 32, 8, 128  # Llama-3-8B
BLOCK = 16  # --block-size
# The FP8 offline workload's decode step: 323 sequences spread over 1024..2047 keys.
MIXED_LENS = [1024 + (i * 1021) % 1024 for i in range(323)]
FORMATS = (("bf16", 2.0), ("fp8", 1 + 4 / D), ("fp8s", 1.0))  # bytes per K/V element


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def caches(seq_lens, query_lens):
    meta, k, v = random_paged_batch(seq_lens, query_lens, H_KV, D, BLOCK, torch.bfloat16, "cuda",
                                    poison_unused=False)
    k8, ks = quantize_fp8_ref(k)
    v8, vs = quantize_fp8_ref(v)
    # Static: one scale per KV head over the whole cache, as a calibrated checkpoint's.
    kss, vss = ((x.float().abs().amax((0, 1, 3)) / FP8_MAX).contiguous() for x in (k, v))
    return meta, {"bf16": (k, v, {}),
                  "fp8": (k8, v8, {"k_scale": ks.contiguous(), "v_scale": vs.contiguous()}),
                  "fp8s": (quantize_fp8_static_ref(k, kss), quantize_fp8_static_ref(v, vss),
                           {"k_scale": kss, "v_scale": vss})}


def decode_row(name, seq_lens):
    meta, formats = caches(seq_lens, [1] * len(seq_lens))
    q = torch.randn(len(seq_lens), H, D, device="cuda", dtype=torch.bfloat16)
    keys = sum(seq_lens)
    row = {"kind": "decode", "shape": name}
    for label, elem in FORMATS:
        k, v, scales = formats[label]
        out = torch.empty_like(q)
        ms = bench(lambda: decode_attention(q, k, v, meta, D ** -0.5, out=out, **scales))
        row[f"{label}_us"] = ms * 1e3
        row[f"{label}_gbs"] = 2 * keys * H_KV * D * elem / (ms * 1e-3) / 1e9
    # Static FP8 runs on the CUDA kernel (kernels/fp8_decode_mma.py) where it applies; the Triton
    # kernel it replaces, same call, for the side-by-side.
    k, v, scales = formats["fp8s"]
    ms = bench(lambda: decode_attention(q, k, v, meta, D ** -0.5, out=out, _mma=False, **scales))
    row["fp8s_triton_us"] = ms * 1e3
    row["fp8s_triton_gbs"] = 2 * keys * H_KV * D / (ms * 1e-3) / 1e9
    return row


def decode_sweep_mma(seq_lens, configs, num_splits=1):
    """Static FP8 decode on the CUDA kernel with each Fp8DecodeConfig (warps, depth, minb), checked
    against the reference."""
    meta, formats = caches(seq_lens, [1] * len(seq_lens))
    k, v, scales = formats["fp8s"]
    q = torch.randn(len(seq_lens), H, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    ref = decode_attention_ref(q, k, v, meta, D ** -0.5, **scales).float()
    timed = {}
    for c in configs:
        cfg = Fp8DecodeConfig(*c)
        timed[str(c)] = bench(lambda: decode_attention(q, k, v, meta, D ** -0.5, out=out, num_splits=num_splits,
                                                       _mma_config=cfg, _mma=True, **scales)) * 1e3
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        if not err < 0.05:
            raise SystemExit(f"fp8s mma decode with {c}: max error {err:.3g} of the largest output")
    return timed


def decode_sweep(seq_lens, configs, label="fp8"):
    """FP8 decode with each (BLOCK_N, num_warps, num_stages): the bf16 table's choice may not
    suit tiles of half the bytes."""
    meta, formats = caches(seq_lens, [1] * len(seq_lens))
    k, v, scales = formats[label]
    q = torch.randn(len(seq_lens), H, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    ref = decode_attention_ref(q, k, v, meta, D ** -0.5, **scales).float()
    timed = {}
    for c in configs:
        timed[str(c)] = bench(lambda: decode_attention(q, k, v, meta, D ** -0.5, out=out, num_splits=1, config=c,
                                                       **scales)) * 1e3
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        if not err < 0.05:  # bf16 rounding and E4M3 reads: ~1e-2 of the largest output at most
            raise SystemExit(f"{label} decode with {c}: max error {err:.3g} of the largest output")
    return timed


def decode_ablation(seq_lens, name="512 x 330"):
    """What the FP8 decode's scale handling costs: 0 as shipped, 1 without any scales, 2 with the V
    scales folded into p (no per-tile normalisation). 1 and 2 are timing experiments only."""
    meta, formats = caches(seq_lens, [1] * len(seq_lens))
    k, v, scales = formats["fp8"]
    q = torch.randn(len(seq_lens), H, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    return {f"{name} ablate {a}": bench(lambda: decode_attention(q, k, v, meta, D ** -0.5, out=out, _ablate=a,
                                                                  **scales)) * 1e3 for a in (0, 1, 2)}


def prefill_row(name, seq_lens):
    meta, formats = caches(seq_lens, seq_lens)
    q = torch.randn(sum(seq_lens), H, D, device="cuda", dtype=torch.bfloat16)
    flops = prefill_flops(meta, H, D)
    row = {"kind": "prefill", "shape": name}
    for label, _ in FORMATS:
        k, v, scales = formats[label]
        out = torch.empty_like(q)
        ms = bench(lambda: prefill_attention(q, k, v, meta, D ** -0.5, out=out, **scales))
        row[f"{label}_us"] = ms * 1e3
        row[f"{label}_tflops"] = flops / (ms * 1e-3) / 1e12
    return row


def main() -> None:
    global BLOCK
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--block-size", type=int, default=16, help="KV block size (the engine's CUDA default: 64)")
    parser.add_argument("--sweep-per-token", action="store_true",
                        help="also the per-token FP8 tile sweep and scale ablations (results/kv-fp8-tiles-*)")
    parser.add_argument("--mma-configs", default="4,2,1;4,3,1;8,2,1;8,1,1;2,2,1;4,1,1",
                        help="Fp8DecodeConfig candidates 'warps,depth,minb;...' for the CUDA kernel's sweep")
    parser.add_argument("--mma-only", action="store_true", help="skip the Triton static-FP8 tile sweep")
    args = parser.parse_args()
    BLOCK = args.block_size
    torch.manual_seed(0)
    rows = [decode_row("512 x 330", [330] * 512), decode_row("200 x 430", [430] * 200),
            decode_row("64 x 1280", [1280] * 64), decode_row("1 x 8192", [8192]),
            decode_row("300 x 1500", [1500] * 300),
            prefill_row("8 x 2048", [2048] * 8)]
    print(f"block size {BLOCK}; us (rate: GB/s of K/V for decode, TFLOP/s for prefill)")
    print(f"{'kind':<8}{'shape':<12}" + "".join(f"{f + ' us':>10}{f + ' rate':>11}" for f, _ in FORMATS)
          + f"{'fp8/bf16':>10}{'fp8s/bf16':>10}{'fp8s tri us':>12}{'rate':>7}")
    for r in rows:
        unit = "gbs" if r["kind"] == "decode" else "tflops"
        print(f"{r['kind']:<8}{r['shape']:<12}" + "".join(f"{r[f + '_us']:>10.1f}{r[f + '_' + unit]:>11.0f}"
                                                           for f, _ in FORMATS)
              + f"{r['bf16_us'] / r['fp8_us']:>9.2f}x{r['bf16_us'] / r['fp8s_us']:>9.2f}x"
              + (f"{r['fp8s_triton_us']:>12.1f}{r['fp8s_triton_gbs']:>7.0f}" if "fp8s_triton_us" in r else ""))
    ablate, sweep = {}, {}
    # Static scales leave the per-token path's register pressure behind: its tiles may differ.
    # A 4th entry caps registers (maxnreg): at 171 (Triton 3.9, sm_90) the (128, 4, 3) static tile
    # fits 2 CTAs an SM, at 168 3 (bf16's 217 KB of tiles in flight), for 24 bytes of spills.
    static_configs = [(128, 4, 3), (128, 4, 3, 168), (128, 4, 4, 168), (64, 2, 6), (32, 2, 8), (64, 2, 6, 168)]
    plans = [] if args.mma_only else [("fp8s", static_configs)]
    mma_sweep = {}
    for name, lens, splits in (("512 x 330", [330] * 512, 1), ("200 x 430", [430] * 200, 1),
                               ("300 x 1500", [1500] * 300, 1),
                               ("330 x 1500", [1500] * 330, 1), ("323 x 1024-2047", MIXED_LENS, 1),
                               ("1 x 8192", [8192], 64)):
        kv_bytes = 2 * sum(lens) * H_KV * D
        timed = decode_sweep_mma(lens, [tuple(int(x) for x in c.split(",")) for c in args.mma_configs.split(";")],
                                 splits)
        mma_sweep[name] = timed
        print(f"fp8s mma decode {name} ({splits} splits) by (warps, depth, minb), us (GB/s): "
              + ", ".join(f"{c} {us:.1f} ({kv_bytes / (us * 1e-6) / 1e9:.0f})" for c, us in timed.items()))
    if args.sweep_per_token:
        ablate = decode_ablation([330] * 512) | decode_ablation([1280] * 64, "64 x 1280")
        print("fp8 decode ablations, us: " + ", ".join(f"{k} {us:.1f}" for k, us in ablate.items()))
        # Small tiles on 2 warps hold few registers, so more CTAs (and their tiles) fit an SM
        # (results/kv-fp8-sass-cpu-20261126/, results/kv-fp8-tiles-h100-20261126/).
        plans.append(("fp8", [(128, 4, 3), (64, 2, 4), (128, 4, 5), (256, 4, 3), (64, 2, 6), (128, 8, 4),
                              (32, 2, 8), (32, 2, 6), (16, 2, 8), (16, 4, 8), (32, 4, 6)]))
    for label, configs in plans:
        elem = dict(FORMATS)[label]
        for name, lens in (("512 x 330", [330] * 512), ("300 x 1500", [1500] * 300)):
            kv_bytes = 2 * sum(lens) * H_KV * D * elem
            timed = decode_sweep(lens, configs, label)
            sweep[f"{label} {name}"] = timed
            print(f"{label} decode {name} by (BLOCK_N, warps, stages), us (GB/s): "
                  + ", ".join(f"{c} {us:.1f} ({kv_bytes / (us * 1e-6) / 1e9:.0f})" for c, us in timed.items()))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"kv_fp8_kernels_bs{BLOCK}.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "block_size": BLOCK, "rows": rows,
                       "decode_sweep_us": sweep, "fp8_decode_ablation_us": ablate, "mma_sweep_us": mma_sweep,
                       "commit": os.environ.get("ROOFLM_COMMIT")}, f, indent=1)


if __name__ == "__main__":
    main()
