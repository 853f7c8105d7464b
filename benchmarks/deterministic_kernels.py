"""Why --deterministic costs what it costs: its kernels against the default ones, Llama-3-8B shapes.

  matmul: the persistent batch-invariant matmul (one tile shape for every M) vs cuBLAS (F.linear)
          for each projection at M = 1, 64, 512, 2048 tokens;
  split:  the fixed-split matmul (split count by weight shape; what --deterministic runs) vs the
          persistent matmul's M buckets vs cuBLAS, per projection at M = 1, 16, 64, 256, 2048, with
          "same sums across M" (each M's rows bitwise equal to those rows of the M = 2048 run),
          both schedules at each M (to place SPLIT_PROGRAMS_MAX_M), the "loop" schedule's tile
          against others at M = 256 and 2048, and S = 1..8 at M = 1 and 64 (split_plan's choice);
  attention: the uniform prefill path (decodes included, no split-KV, every key tile masked) vs
          the default launches (split-KV decode kernel; prefill with TMA and unmasked tiles).

  tma:    the persistent matmul with TMA tile loads vs its pointer loads vs cuBLAS (--part tma).
  small:  decode-size tile candidates (M = 1, 16, 64) under CUDA graphs vs the bucket's and
          cuBLAS, with whether each sums like the prefill bucket (--part small).
  decode: the same for the batch-1 question, every projection and the LM head, BLOCK_K 128,
          BLOCK_M 16 and two programs per SM among the candidates (--part decode).

Times are triton.testing.do_bench medians (ms). Writes kernels.json under --out.
`--part split` runs the split part alone (about a minute on an H100, by estimate).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from rooflm.layers.cuda_attention import TritonBackend
from rooflm.kernels.matmul_fixed_split import SCHEDULES, loop_config, matmul_fixed_split, split_plan
from rooflm.kernels.matmul_persistent import matmul_bytes, matmul_flops, matmul_persistent
from rooflm.kernels.prefill_attention import plan_prefill_attention, prefill_attention
from tests.kernels.helpers import random_paged_batch

DEVICE = "cuda"
PROJECTIONS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
               "lm_head": (128256, 4096)}


def operands(names, ms):
    """(name, n, k, m, x, w) for each projection named and each M: W [N, K] scaled by 1 / sqrt(K),
    drawn once per projection, x [M, K] once per M, bf16 on DEVICE."""
    for name in names:
        n, k = PROJECTIONS[name]
        w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) / k ** 0.5
        for m in ms:
            yield name, n, k, m, torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16), w


# Tile shapes (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages) to compare with the table's: a
# shape-dependent (never M-dependent) choice could fill more SMs for the narrow projections.
CANDIDATES = [(128, 64, 64, 8, 4, 4), (64, 64, 64, 8, 4, 4), (128, 256, 64, 8, 8, 3)]


def bench_tile_shapes() -> list[dict]:
    """Each candidate against the table's shape at M = 1 and 2048, and whether it sums like it
    (bitwise equal outputs: then BLOCK_M / BLOCK_N could change without changing any token)."""
    from rooflm.kernels.matmul_persistent import matmul_config
    rows = []
    base = matmul_config(torch.bfloat16, 2048)
    for name, n, k, m, x, w in operands(("o", "down", "gate_up"), (1, 2048)):
        ref = matmul_persistent(x, w, config=base)
        t_base = do_bench(lambda: matmul_persistent(x, w, config=base), return_mode="median")
        for cand in CANDIDATES:
            t = do_bench(lambda: matmul_persistent(x, w, config=cand), return_mode="median")
            same = bool(torch.equal(matmul_persistent(x, w, config=cand), ref))
            rows.append(dict(kernel="matmul-tiles", shape=name, m=m, config=list(cand), ms=t,
                             table_ms=t_base, sums_like_table=same))
            print(f"tiles {name:8s} M={m:5d} {cand}: {t:7.3f} ms (table {t_base:7.3f})  same sums: {same}",
                  flush=True)
    return rows


def bench_matmul() -> list[dict]:
    rows = []
    for name, n, k, m, x, w in operands(PROJECTIONS, M_VALUES):
        t_cublas = do_bench(lambda: F.linear(x, w), return_mode="median")
        t_det = do_bench(lambda: matmul_persistent(x, w), return_mode="median")
        row = dict(kernel="matmul", shape=name, m=m, n=n, k=k, cublas_ms=t_cublas, deterministic_ms=t_det,
                   ratio=t_det / t_cublas, det_tflops=matmul_flops(m, n, k) / t_det / 1e9,
                   det_gbs=matmul_bytes(m, n, k, 2) / t_det / 1e6)
        rows.append(row)
        print(f"matmul {name:8s} M={m:5d}  cuBLAS {t_cublas:7.3f} ms  persistent {t_det:7.3f} ms  "
              f"x{row['ratio']:.2f}  ({row['det_tflops']:.0f} TFLOP/s, {row['det_gbs']:.0f} GB/s)", flush=True)
    return rows


SPLIT_M_VALUES = (1, 16, 64, 256, 2048)
LOOP_CANDIDATES = [(128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (64, 256, 64, 8, 8, 3), (64, 128, 64, 8, 4, 4),
                   (64, 64, 64, 8, 4, 6)]


def bench_fixed_split() -> list[dict]:
    """Per projection and M: cuBLAS, the persistent matmul (current buckets), the fixed-split
    matmul (split_plan's S, schedule by M), and whether the split version's rows are bitwise
    those of the M = 2048 run (its batch invariance on this GPU)."""
    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, (n, k) in PROJECTIONS.items():
        splits, split_k = split_plan(n, k, torch.bfloat16, sms)
        w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) / k ** 0.5
        x_all = torch.randn(max(SPLIT_M_VALUES), k, device=DEVICE, dtype=torch.bfloat16)
        full = matmul_fixed_split(x_all, w)
        for m in SPLIT_M_VALUES:
            x = x_all[:m].clone()
            t_cublas = do_bench(lambda: F.linear(x, w), return_mode="median")
            t_bucket = do_bench(lambda: matmul_persistent(x, w), return_mode="median")
            t_split = do_bench(lambda: matmul_fixed_split(x, w), return_mode="median")
            same = bool(torch.equal(matmul_fixed_split(x, w), full[:m]))
            by_schedule = {}
            if splits > 1:  # both schedules, each checked against the M = 2048 rows too
                for schedule in SCHEDULES:
                    t = do_bench(lambda: matmul_fixed_split(x, w, schedule=schedule), return_mode="median")
                    by_schedule[schedule] = dict(
                        ms=t, same_sums=bool(torch.equal(matmul_fixed_split(x, w, schedule=schedule), full[:m])))
            row = dict(kernel="matmul-split", shape=name, m=m, n=n, k=k, splits=splits, split_k=split_k,
                       cublas_ms=t_cublas, bucket_ms=t_bucket, split_ms=t_split, same_sums_across_m=same,
                       schedules=by_schedule, split_gbs=matmul_bytes(m, n, k, 2) / t_split / 1e6)
            rows.append(row)
            sched = "  ".join(f"{s} {v['ms']:.3f}{'' if v['same_sums'] else ' (DIFFERENT SUMS)'}"
                              for s, v in by_schedule.items())
            print(f"split  {name:8s} M={m:5d} S={splits}  cuBLAS {t_cublas:7.3f}  bucket {t_bucket:7.3f} "
                  f"(x{t_bucket / t_cublas:.2f})  split {t_split:7.3f} (x{t_split / t_cublas:.2f}, "
                  f"{row['split_gbs']:.0f} GB/s)  same sums across M: {same}  {sched}", flush=True)
        del w, x_all, full
    # The "loop" schedule's tile (capped at 128 x 128: acc + total in registers), against others
    # that fit, at prefill sizes; each must sum like the default (else it could not be used).
    for name, n, k, m, x, w in operands(("o", "down", "qkv"), (256, 2048)):
        ref = matmul_fixed_split(x, w, schedule="loop")
        for cand in LOOP_CANDIDATES:
            t = do_bench(lambda: matmul_fixed_split(x, w, schedule="loop", config=cand), return_mode="median")
            same = bool(torch.equal(matmul_fixed_split(x, w, schedule="loop", config=cand), ref))
            rows.append(dict(kernel="matmul-split-loop-tiles", shape=name, m=m, config=list(cand), ms=t,
                             default_config=list(loop_config(torch.bfloat16, m)), same_sums=same))
            print(f"loop tiles {name:6s} M={m:5d} {cand}: {t:7.3f} ms  same sums: {same}", flush=True)
    # Is split_plan's S the right one? Every S at decode sizes, "programs" schedule.
    for name, n, k, m, x, w in operands(("o", "down", "qkv"), (1, 64)):
        times = {s: do_bench(lambda: matmul_fixed_split(x, w, splits=s, schedule="programs"),
                             return_mode="median") for s in range(1, 9)}
        rows.append(dict(kernel="matmul-split-count", shape=name, m=m, ms_by_splits=times,
                         planned=split_plan(n, k, torch.bfloat16, sms)[0]))
        print(f"splits {name:8s} M={m:3d} planned S={rows[-1]['planned']}: "
              + "  ".join(f"S={s} {t:.4f}" for s, t in times.items()), flush=True)
    return rows


ATTENTION_CASES = {"decode 1 x 1152": ([1152], [1]), "decode 64 x 1280": ([1280] * 64, [1] * 64),
                   "prefill 1 x 2048": ([2048], [2048]), "prefill 8 x 1024": ([1024] * 8, [1024] * 8)}
M_VALUES = (1, 64, 512, 2048)


def bench_attention() -> list[dict]:
    rows = []
    for name, (seq_lens, query_lens) in ATTENTION_CASES.items():
        meta, k_cache, v_cache = random_paged_batch(seq_lens, query_lens, 8, 128, 16, torch.bfloat16, DEVICE,
                                                    poison_unused=False)
        q = torch.randn(sum(query_lens), 32, 128, device=DEVICE, dtype=torch.bfloat16)
        out = torch.empty_like(q)
        times = {}
        for label, backend in (("default", TritonBackend(split_span=2048)),
                               ("deterministic", TritonBackend(split_span=2048, deterministic=True))):
            meta.plan = None
            plan = backend.plan(q, k_cache, v_cache, meta, None, out)

            def step(backend=backend, plan=plan):
                meta.plan = plan
                backend.attend(q, k_cache, v_cache, meta, 128 ** -0.5, None, out=out)
            times[label] = do_bench(step, return_mode="median")
        if query_lens[0] == 1:  # decodes: would a shorter query tile sum alike (and how fast)?
            uniform = TritonBackend(deterministic=True)
            meta.plan = None
            table_plan = uniform.plan(q, k_cache, v_cache, meta, None, out)
            ref = out.clone()
            uniform.attend(q, k_cache, v_cache, meta, 128 ** -0.5, None, out=ref)
            for block_m in (64, 16):
                config = (block_m,) + table_plan[1].config[1:]  # plan: (decode None, prefill)
                plan = plan_prefill_attention(q, k_cache, v_cache, meta, None, out=out, config=config,
                                              uniform=True)
                alt = torch.empty_like(out)
                prefill_attention(q, k_cache, v_cache, meta, 128 ** -0.5, None, out=alt, plan=plan)
                t = do_bench(lambda: prefill_attention(q, k_cache, v_cache, meta, 128 ** -0.5, None, out=alt,
                                                       plan=plan), return_mode="median")
                same = bool(torch.equal(alt, ref))
                rows.append(dict(kernel="attention-tiles", case=name, config=list(config), ms=t, sums_like_table=same))
                print(f"attention {name:18s} uniform BLOCK_M={block_m}: {t:7.3f} ms  same sums: {same}", flush=True)
        rows.append(dict(kernel="attention", case=name, default_ms=times["default"],
                         deterministic_ms=times["deterministic"], ratio=times["deterministic"] / times["default"]))
        print(f"attention {name:18s} default {times['default']:7.3f} ms  uniform {times['deterministic']:7.3f} ms  "
              f"x{rows[-1]['ratio']:.2f}", flush=True)
    return rows


TMA_CONFIGS = [(128, 256, 64, 8, 8, 3), (128, 256, 64, 8, 8, 4), (128, 128, 64, 8, 8, 4), (128, 128, 64, 8, 4, 4),
               (64, 256, 64, 8, 4, 4)]
# Decode sizes: narrow tiles spread the weight reads over the SMs (the pointer bucket is 64 x 64).
TMA_SMALL_CONFIGS = [(64, 64, 64, 8, 4, 6), (64, 64, 64, 8, 4, 4), (64, 32, 64, 8, 4, 6), (64, 128, 64, 8, 4, 4)]
M_TMA = [int(m) for m in os.environ.get("M_TMA", "64,512,2048").split(",")]


def bench_tma() -> list[dict]:
    """The persistent matmul with TMA tile loads against its pointer loads and cuBLAS, per
    projection at M = 512 and 2048 (prefill chunks) and 64, with candidate tiles (BLOCK_K 64:
    the sums do not change), and whether TMA's rows are bitwise the pointer kernel's."""
    rows = []
    for name, n, k, m, x, w in operands(PROJECTIONS, M_TMA):
        t_cublas = do_bench(lambda: F.linear(x, w), return_mode="median")
        t_ptr = do_bench(lambda: matmul_persistent(x, w, tma=False), return_mode="median")
        same = torch.equal(matmul_persistent(x, w, tma=True), matmul_persistent(x, w, tma=False))
        row = dict(kernel="tma", shape=name, m=m, cublas_ms=t_cublas, pointer_ms=t_ptr, same_sums=same)
        for cfg in (TMA_SMALL_CONFIGS if m <= 64 else TMA_CONFIGS):
            row[f"tma {cfg}"] = do_bench(lambda: matmul_persistent(x, w, config=cfg, tma=True),
                                         return_mode="median")
        best = min((v, c) for c, v in row.items() if c.startswith("tma ("))
        rows.append(row)
        print(f"tma {name:8s} M={m:5d} cuBLAS {t_cublas:7.3f} pointer {t_ptr:7.3f} (x{t_ptr / t_cublas:.2f}) "
              f"best TMA {best[0]:7.3f} (x{best[0] / t_cublas:.2f}) {best[1][4:]}  same sums {same}", flush=True)
    return rows


# The decode bucket (M <= 64): narrower tiles fill more SMs for the narrow projections (o and down
# have 64 tiles of 64 x 64 for 132 SMs). BLOCK_K 128 is there to see whether it sums like 64.
SMALL_CONFIGS = [(64, bn, bk, 8, 4, st) for bn in (16, 32, 64) for bk in (64,) for st in (4, 6, 8, 12)] + \
    [(64, 32, 128, 8, 4, 4), (64, 64, 128, 8, 4, 4)]
M_SMALL = (1, 16, 64)


def bench_small() -> list[dict]:
    """Decode-size tiles under CUDA graphs (no launch gaps, no cache flush: as a captured decode
    step runs them) against the table's bucket and cuBLAS, with the bytes each moves per second,
    and whether each candidate's rows are bitwise the prefill bucket's (then it can replace it)."""
    return sweep_tiles("small", ("qkv", "o", "gate_up", "down"), M_SMALL, SMALL_CONFIGS)


# Batch-1 decode (last miss): the decode bucket's tiles at M = 1, 16 and 64 for every
# projection and the LM head, with BLOCK_K 128 (the sweep above found it sums like 64), BLOCK_M 16
# (Triton's mma.sync path instead of wgmma: does it sum alike?) and two programs per SM (a 7th
# entry) for tiles too small to keep enough bytes in flight alone.
DECODE_CONFIGS = [(64, 64, 64, 8, 4, 8), (64, 32, 64, 8, 4, 12),
                  (64, 64, 128, 8, 4, 4), (64, 64, 128, 8, 4, 6),
                  (64, 32, 128, 8, 4, 4), (64, 32, 128, 8, 4, 6), (64, 32, 128, 8, 4, 4, 2),
                  (64, 16, 128, 8, 4, 4, 2), (64, 16, 128, 8, 4, 6, 2),
                  (16, 64, 128, 8, 4, 4), (16, 64, 128, 8, 4, 8), (16, 32, 128, 8, 4, 6), (16, 32, 128, 8, 4, 6, 2),
                  (16, 16, 256, 8, 4, 4, 2), (16, 64, 256, 8, 4, 4), (16, 32, 256, 8, 4, 4, 2)]
# The second round (after the batch-1 tiles went in): deeper pipelines, wider or longer tiles.
DECODE_CONFIGS_2 = [(64, 32, 128, 8, 4, 6), (16, 64, 256, 8, 4, 4), (16, 64, 256, 8, 4, 5),
                    (16, 128, 256, 8, 4, 3), (16, 128, 128, 8, 4, 6), (16, 64, 128, 8, 4, 12),
                    (16, 32, 256, 8, 4, 6), (64, 64, 128, 8, 4, 7), (32, 64, 256, 8, 4, 4),
                    (64, 32, 256, 8, 4, 4), (16, 64, 512, 8, 4, 2), (16, 32, 512, 8, 4, 4)]
if os.environ.get("DECODE_ROUND") == "2":
    DECODE_CONFIGS = DECODE_CONFIGS_2
M_DECODE = tuple(int(v) for v in os.environ.get("DECODE_MS", "1,16,64").split(","))


def bench_decode() -> list[dict]:
    """DECODE_CONFIGS under CUDA graphs per projection at decode sizes (bench_small's question for
    the batch-1 bucket, the LM head included)."""
    return sweep_tiles("decode", ("qkv", "o", "gate_up", "down", "lm_head"), M_DECODE, DECODE_CONFIGS)


def sweep_tiles(label: str, shapes, ms, configs) -> list[dict]:
    """Each config under CUDA graphs per shape and M, against the table's and cuBLAS, and whether
    its rows are bitwise the M = 2048 (prefill bucket) run's rows."""
    from triton.testing import do_bench_cudagraph
    from rooflm.kernels.matmul_persistent import matmul_config
    from rooflm.kernels.utils import num_sms
    rows = []
    for name, n, k, m, x, w in operands(shapes, ms):
        big = torch.randn(2048, k, device=DEVICE, dtype=torch.bfloat16)
        big[:m] = x
        ref = matmul_persistent(big, w)[:m]  # the prefill bucket's rows
        table = matmul_config(torch.bfloat16, m, n, num_sms())
        gb = n * k * 2 / 1e6
        t_cublas = do_bench_cudagraph(lambda: F.linear(x, w), rep=40)
        t_table = do_bench_cudagraph(lambda: matmul_persistent(x, w, config=table), rep=40)
        best = (t_table, table)
        for cfg in configs:
            try:
                t = do_bench_cudagraph(lambda: matmul_persistent(x, w, config=cfg), rep=40)
                same = bool(torch.equal(matmul_persistent(x, w, config=cfg), ref))
            except Exception as e:  # noqa: BLE001 (a tile that does not fit: say so, go on)
                print(f"{label} {name} M={m} {cfg}: {type(e).__name__}", flush=True)
                continue
            rows.append(dict(kernel=label, shape=name, m=m, config=list(cfg), ms=t, table_ms=t_table,
                             cublas_ms=t_cublas, gbs=gb / t, same_sums=same))
            if same and t < best[0]:
                best = (t, cfg)
            print(f"{label} {name:8s} M={m:3d} {str(cfg):32s} {t * 1e3:7.1f} us {gb / t:5.0f} GB/s"
                  f"{'' if same else '  sums DIFFER from prefill rows'}", flush=True)
        print(f"{label.upper()} {name:8s} M={m:3d} cuBLAS {t_cublas * 1e3:.1f} us ({gb / t_cublas:.0f} GB/s) table "
              f"{t_table * 1e3:.1f} us ({gb / t_table:.0f} GB/s) best {best[0] * 1e3:.1f} us "
              f"({gb / best[0]:.0f} GB/s) {best[1]}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--part", choices=("all", "split", "tma", "small", "decode"), default="all")
    args = ap.parse_args()
    if args.part == "tma":
        rows = bench_tma()
    elif args.part == "small":
        rows = bench_small()
    elif args.part == "decode":
        rows = bench_decode()
    elif args.part == "split":
        rows = bench_fixed_split()
    else:
        rows = bench_matmul() + bench_fixed_split() + bench_attention() + bench_tile_shapes()
    with open(os.path.join(args.out, "kernels.json" if args.part == "all" else f"kernels-{args.part}.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, "rows": rows,
                   "part": args.part}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
