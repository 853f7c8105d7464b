"""W4A16 / W8A16 tiles on the Llama-3-8B linear shapes at batch 1, 4, 16, 64: one GPU call (< 4 min).

For each layer shape and batch, on the same GPU and the same random codes:
  bf16    F.linear on a bf16 weight of the shape;
  heur    the new kernels with pick_config's heuristic (no table);
  cand    the new kernels' candidate configs (W4Config / W8Config fields in the rows).
Each: microseconds per call (median of CUDA-graph replays, a replay calling the op on R weight copies
in turn, R x the int4 weight >= 256 MB, so no copy is still in the 50 MB L2), GB/s of the bytes the
format moves (codes + scales/zeros + x + y; bf16: its 2 N K + x + y), and the error against
dequantize-then-fp32 (tests.kernels.helpers.rel_error, and the max abs error).

Writes OUT/quant_gemv_sweep.json (every row) and, with --table, the fastest config within the dtype's
tolerance per (kernel, N, K, group, M) into rooflm/kernels/tuned/weight_only.json under this GPU's
name: what pick_config reads (rooflm/kernels/tuned_configs.py). Compiling the candidates is most of
the time; they compile on a batch's first shape and --budget-s splits the time over the batches by
their candidates, skipping (and printing) the candidates left when a batch's share is spent.

Usage (GPU, repo root): TRITON_CACHE_DIR=$PWD/.triton-cache python benchmarks/quant_gemv_sweep.py --out DIR --table
       python benchmarks/quant_gemv_sweep.py --smoke --out DIR   tiny shapes (on a CPU: the interpreter and
                                                                 wall-clock times): the plumbing, not speed
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}  # the int4 LM head (decode quantizes it): --shapes only
DEFAULT_SHAPES = ("qkv", "o", "gate_up", "down")
BATCHES = (1, 4, 16, 64)
GROUP = 128
SMOKE_SHAPES = {"tiny_even": (48, 256), "tiny_odd": (40, 448)}  # 448 / 64: an odd group count
SMOKE_BATCHES = (1, 5)
SMOKE_GROUP = 64
L2_FLUSH_BYTES = 256 * 2**20


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="directory for quant_gemv_sweep.json")
    ap.add_argument("--table", nargs="?", const="", default=None,
                    help="merge the best configs into this tile table (default: rooflm's weight_only.json)")
    ap.add_argument("--budget-s", type=float, default=200.0, help="wall-clock budget for the whole sweep")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,4,16,64)")
    ap.add_argument("--shapes", default=None, help="comma-separated layer names (default the four of a "
                    "decoder layer; lm_head: the 128256 x 4096 head)")
    ap.add_argument("--kernels", default="w4a16,w8a16", help="which weight-only kernels to sweep")
    ap.add_argument("--replays", type=int, default=20, help="CUDA-graph replays per timing")
    ap.add_argument("--max-candidates", type=int, default=None, help="the first N candidates of each list")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes (plumbing check)")
    return ap.parse_args(argv)


# --------------------------------------------------------------------------
# Candidates
# --------------------------------------------------------------------------

def w4_candidates(m: int, group: int):
    from rooflm.kernels.w4a16 import W4Config
    bk = 2 * max(group, 128)  # one group (or 128 codes) of each nibble per step
    if m == 1:
        # The folded GEMV (fold=True at block_m 1, 2026-11-27: 4.0-5.4 instructions a weight and
        # 95-128 registers in sm_90 SASS, against 6.6 and 128-167 for the per-weight GEMV). First:
        # the budget skips the end of a list.
        # x_sums: x's group sums from one small launch, not a cross-thread sum in every step.
        xs = [W4Config(1, bn, bk, w, 4, sk, x_sums=True) for bn, w, sk in
              ((16, 2, 4), (32, 2, 2), (32, 2, 1), (64, 2, 2), (64, 2, 1), (32, 4, 2), (64, 2, 4))]
        xs += [W4Config(16, 64, bk, 4, 3, sk, swap_ab=True, x_sums=True) for sk in (1, 2, 4)]
        gemv = xs + [W4Config(1, bn, bk, w, 4, sk) for bn, w in ((32, 2), (64, 2), (32, 4), (64, 4), (128, 4))
                     for sk in (1, 2, 4)]
        gemv += [W4Config(1, 64, bk, 2, 6, 2), W4Config(1, 32, bk, 2, 6, 2), W4Config(1, 64, 2 * bk, 2, 3, 2),
                 W4Config(1, 16, bk, 2, 4, 4), W4Config(1, 128, bk, 8, 4, 1), W4Config(1, 64, bk, 2, 4, 8)]
        # What the table held before it, side by side: swap-AB m16 n64 split 4 (qkv, o, down) and the
        # per-weight GEMV n32 2 warps split 2 (gate_up), then the rest of the earlier lists.
        before = [W4Config(16, 64, bk, 4, 3, 4, swap_ab=True), W4Config(1, 32, bk, 2, 4, 2, fold=False)]
        tensor = [W4Config(16, 64, bk, 4, 3, sk, swap_ab=True) for sk in (1, 2, 3, 6)]
        tensor += [W4Config(16, 32, bk, 4, 3, sk, swap_ab=True) for sk in (3, 6, 8)]
        tensor += [W4Config(16, bn, bk, 4, 3, sk) for bn in (32, 64) for sk in (1, 2, 4)]
        # The per-weight GEMV's earlier candidates (register caps: all slower on the H100, 2026-11-27).
        old = [W4Config(1, bn, kk, 4, 3, sk, fold=False) for bn in (16, 32) for kk in (bk, 2 * bk) for sk in (1, 2, 4)]
        old += [W4Config(1, 64, bk, 4, 4, 1, fold=False), W4Config(1, 32, bk, 2, 4, 2, fold=False, maxnreg=128)]
        return gemv + before + tensor + old
    bms = (16,) if m <= 16 else (32, 64)
    out = swap_ab_candidates(m, bk)  # first: the budget skips the end of a list
    out += [W4Config(bm, bn, bk, 4, 3, sk) for bm in bms for bn in (32, 64, 128) for sk in (1, 2)]
    # the per-weight dequant (fold=False) beside the per-group fold on the middle tile
    out += [W4Config(bm, 64, bk, 4, 3, 1, fold=False) for bm in bms]
    # (block_k 2 x 256 with block_m 64 needs 256 KB of shared memory at 3 stages: over the H100's 227)
    out += [c for bm in bms for c in ((W4Config(bm, 64, 2 * bk, 4, 3, 1),) if bm < 64 else ())
            + (W4Config(bm, 64, bk, 8, 4, 1), W4Config(bm, 64, bk, 4, 2, 1))]
    return out


def swap_ab_candidates(m: int, bk: int):
    """Tensor-core tiles computing y.T = W @ x.T (the unpacked W wgmma's A operand, from registers):
    block_n is wgmma's M (64 a warpgroup), block_m its N. Tiles that compile for sm_90 without
    spills (benchmarks/quant_gemv_sass.py; 4 warps with block_n 128 spill), fold and per-weight."""
    from rooflm.kernels.w4a16 import W4Config
    if m <= 16:
        out = [W4Config(16, 64, bk, 4, 3, sk, x_sums=True) for sk in (1, 2, 4)]
        out += [W4Config(16, 64, bk, 4, 3, sk, fold) for sk in (1, 2, 4) for fold in (True, False)]
        out += [W4Config(16, 128, bk, 8, 3, sk) for sk in (1, 2)] + [W4Config(16, 64, bk, 4, 4, 1)]
    else:
        # x_sums first: the fold's row sums of x were as costly as the unpacking at 64 rows
        out = [W4Config(64, 64, bk, 4, 3, sk, x_sums=True) for sk in (1, 2)]
        out += [W4Config(64, 128, bk, 8, 3, 1, x_sums=True), W4Config(32, 64, bk, 4, 3, 1, x_sums=True)]
        out += [W4Config(64, 64, bk, 4, 3, sk, fold) for sk in (1, 2) for fold in (True, False)]
        out += [W4Config(64, 128, bk, 8, 3, 1, fold) for fold in (True, False)]
        out += [W4Config(32, 64, bk, 4, 3, 1, fold) for fold in (True, False)]
    return [c._replace(swap_ab=True) for c in out]


def w8_candidates(m: int):
    from rooflm.kernels.w8a16 import W8Config
    if m == 1:
        out = [W8Config(1, bn, bk, 4, 3, sk) for bn in (8, 16, 32) for bk in (256, 512) for sk in (1, 2, 4)]
        return out + [W8Config(1, 16, 128, 4, 3, 2), W8Config(1, 32, 1024, 8, 3, 1), W8Config(1, 16, 256, 4, 5, 2),
                      W8Config(16, 64, 128, 4, 3, 1), W8Config(16, 64, 128, 4, 3, 2)]
    bms = (16,) if m <= 16 else (32, 64)
    out = [W8Config(bm, bn, 128, 4, 3, sk) for bm in bms for bn in (32, 64, 128) for sk in (1, 2)]
    return out + [W8Config(bm, 64, 64, 4, 3, 1) for bm in bms]


# --------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------

def make_timer(cuda: bool, replays: int):
    import torch

    if not cuda:
        def wall(thunks):
            for t in thunks[:1]:
                t()
            t0 = time.perf_counter()
            for t in thunks:
                t()
            return (time.perf_counter() - t0) * 1e6 / len(thunks)
        return wall

    def graphed(thunks):
        """us per call: one graph calls every thunk once (each its own weight copy); median replay."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compile and allocate outside the capture
            for t in thunks:
                t()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for t in thunks:
                t()
        graph.replay()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
        for start, end in events:
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        us = statistics.median(s.elapsed_time(e) for s, e in events) * 1e3 / len(thunks)
        del graph
        return us
    return graphed


# --------------------------------------------------------------------------
# Sweep
# --------------------------------------------------------------------------

def run(args) -> dict:
    import torch
    import torch.nn.functional as F

    from rooflm.kernels import w4a16 as new4, w8a16 as new8
    from tests.kernels.helpers import REL_TOL, rel_error
    from rooflm.kernels.int4_pack import pack_int4

    cuda = torch.cuda.is_available()  # --smoke on a GPU: tiny shapes, compiled and graphed
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float16  # bf16 tl.dot is wrong only in the interpreter
    shapes = SMOKE_SHAPES if args.smoke else {k: SHAPES[k] for k in DEFAULT_SHAPES}
    if args.shapes:
        shapes = {k: (SMOKE_SHAPES if args.smoke else SHAPES)[k] for k in args.shapes.split(",")}
    kernels = set(args.kernels.split(","))
    batches = tuple(int(b) for b in args.batches.split(",")) if args.batches else (
        SMOKE_BATCHES if args.smoke else BATCHES)
    group = SMOKE_GROUP if args.smoke else GROUP
    device_name = torch.cuda.get_device_name() if cuda else "cpu-interpreter"
    sms = torch.cuda.get_device_properties(0).multi_processor_count if cuda else 132
    tol = REL_TOL[dtype]
    bench = make_timer(cuda, args.replays)
    t_start = time.perf_counter()
    rows, skipped = [], []
    gen = torch.Generator(device=dev).manual_seed(0)

    def measure(case, kernel, variant, cfg, thunks, out, ref, nbytes):
        row = dict(case, kernel=kernel, variant=variant, config=None if cfg is None else cfg._asdict())
        try:
            err = rel_error(out(), ref)
            row.update(us=bench(thunks), rel_err=err, max_abs_err=(out().float() - ref.float()).abs().max().item())
            row.update(gbs=nbytes / row["us"] / 1e3, ok=bool(err < tol))
        except Exception as e:  # a config that does not compile or fit (shared memory, registers)
            row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        rows.append(row)
        return row

    print(f"{device_name}, {sms} SMs, {dtype}, group {group}; batches {batches}; budget {args.budget_s:.0f} s")
    # Each batch's share of the budget in proportion to its candidates (batch 1 has the most); a
    # batch runs candidates until its cumulative deadline, so what one leaves goes to the next.
    counts = [len(w4_candidates(m, group)) + len(w8_candidates(m)) + 5 for m in batches]
    for bi, m in enumerate(batches):
        deadline = t_start + args.budget_s * sum(counts[:bi + 1]) / sum(counts)
        for name, (n, k) in shapes.items():
            reps = 1 if not cuda else min(32, max(2, -(-L2_FLUSH_BYTES // (n * k // 2))))
            codes = [torch.randint(0, 16, (n, k), device=dev, dtype=torch.uint8, generator=gen) for _ in range(reps)]
            q4 = [pack_int4(c, group) for c in codes]
            del codes
            s4 = (torch.rand(k // group, n, device=dev, generator=gen) * 0.01 + 0.001).to(dtype)
            z4 = torch.randint(0, 16, (k // group, n), device=dev, generator=gen).to(dtype)
            q8 = [torch.randint(-128, 128, (n, k), device=dev, dtype=torch.int8, generator=gen) for _ in range(reps)]
            s8 = (torch.rand(n, device=dev, generator=gen) * 1e-3 + 1e-4).to(dtype)
            w16 = [torch.randn(n, k, device=dev, dtype=dtype, generator=gen) * 0.02 for _ in range(reps)]
            x = torch.randn(m, k, device=dev, dtype=dtype, generator=gen)
            ref4 = x.float() @ new4.dequantize_w4(q4[0], s4, z4, group).T  # fp32, not rounded to x's dtype
            ref8 = x.float() @ new8.dequantize_w8(q8[0], s8).T
            case = dict(shape=name, n=n, k=k, m=m, group=group)
            b16 = 2 * n * k + 2 * m * (n + k)
            b4, b8 = new4.w4a16_bytes(m, n, k, group), new8.w8a16_bytes(m, n, k)

            measure(case, "bf16", "F.linear", None, [lambda w=w: F.linear(x, w) for w in w16],
                    lambda: F.linear(x, w16[0]).float(), (x.float() @ w16[0].float().T), b16)
            heur8, heur4 = new8.pick_config(m, n, k, None, sms), new4.pick_config(m, n, k, group, None, sms)
            todo = [("w8a16", "heur", heur8)] + [("w4a16", "heur", heur4)]
            todo = [t for t in todo if t[0] in kernels]
            cap = args.max_candidates
            cands4 = w4_candidates(m, group)[:cap]
            if heur4.block_m > 1:  # the heuristic's tile swapped: its split-K is sized for this shape
                cands4 = [heur4._replace(swap_ab=True)] + [c for c in cands4 if c != heur4._replace(swap_ab=True)]
            todo += [("w4a16", "cand", c) for c in cands4 if c != heur4]
            if "w8a16" in kernels:
                todo += [("w8a16", "cand", c) for c in w8_candidates(m)[:cap] if c != heur8]
            for kernel, variant, cfg in todo:
                if variant == "cand" and time.perf_counter() > deadline:
                    skipped.append(dict(case, kernel=kernel, config=cfg._asdict()))
                    continue
                if kernel == "w4a16":
                    measure(case, kernel, variant, cfg,
                            [lambda q=q, c=cfg: new4.w4a16_linear(x, q, s4, z4, group, config=c) for q in q4],
                            lambda c=cfg: new4.w4a16_linear(x, q4[0], s4, z4, group, config=c), ref4, b4)
                else:
                    measure(case, kernel, variant, cfg,
                            [lambda q=q, c=cfg: new8.w8a16_linear(x, q, s8, config=c) for q in q8],
                            lambda c=cfg: new8.w8a16_linear(x, q8[0], s8, config=c), ref8, b8)
            print_case(rows, name, m)
            del q4, q8, w16
            if cuda:
                torch.cuda.empty_cache()
    if skipped:
        print(f"\nbudget: {len(skipped)} candidate runs skipped (listed in the JSON under 'skipped')")
    print(f"sweep wall time {time.perf_counter() - t_start:.0f} s")
    return dict(device=device_name, sms=sms, dtype=str(dtype), group=group, rows=rows, skipped=skipped,
                wall_s=time.perf_counter() - t_start)


def _cfg(c: dict | None) -> str:
    if not c:
        return ""
    return (f"m{c['block_m']} n{c['block_n']} k{c['block_k']} w{c['num_warps']} s{c['num_stages']}"
            + (f" x{c['split_k']}" if c.get("split_k", 1) > 1 else "")
            + (" nofold" if c.get("fold") is False else "")
            + (" swap" if c.get("swap_ab") else "")
            + (f" r{c['maxnreg']}" if c.get("maxnreg") else "")
            + (" xs" if c.get("x_sums") else ""))


def best_rows(rows, shape, m, kernel):
    """The measured new-kernel rows of one case, within tolerance, fastest first."""
    return sorted((r for r in rows if r["shape"] == shape and r["m"] == m and r["kernel"] == kernel
                   and r["variant"] in ("heur", "cand") and r.get("ok")), key=lambda r: r["us"])


def print_case(rows, shape, m):
    def one(kernel, variant):
        r = next((r for r in rows if r["shape"] == shape and r["m"] == m and r["kernel"] == kernel
                  and r["variant"] == variant), None)
        if r is None:
            return "-"
        if "error" in r:
            return f"ERROR {r['error'][:60]}"
        return f"{r['us']:7.1f} us {r['gbs']:5.0f} GB/s err {r['rel_err']:.1e}{'' if r['ok'] else ' (OVER TOL)'}"

    bf16 = next(r for r in rows if r["shape"] == shape and r["m"] == m and r["kernel"] == "bf16")
    print(f"\n{shape} M={m}: bf16 {one('bf16', 'F.linear')}")
    for kernel in ("w8a16", "w4a16"):
        print(f"  {kernel} heur {one(kernel, 'heur')}")
        for r in best_rows(rows, shape, m, kernel)[:3]:
            print(f"  {kernel} best {r['us']:7.1f} us {r['gbs']:5.0f} GB/s err {r['rel_err']:.1e}  "
                  f"[{_cfg(r['config'])}]  {bf16.get('us', float('nan')) / r['us']:.2f}x bf16")
        bad = [r for r in rows if r["shape"] == shape and r["m"] == m and r["kernel"] == kernel
               and ("error" in r or not r.get("ok", True))]
        if bad:
            print(f"  {kernel}: {len(bad)} configs failed or over tolerance, e.g. [{_cfg(bad[0]['config'])}] "
                  f"{bad[0].get('error', 'rel_err %.1e' % bad[0].get('rel_err', float('nan')))}")


def merge_table(result: dict, path: str) -> dict:
    """Put the fastest in-tolerance config of each (kernel, N, K, group, M) under the GPU's name."""
    table = {}
    if os.path.exists(path):
        with open(path) as f:
            table = json.load(f)
    mine = table.setdefault(result["device"], {})
    cases = {(r["shape"], r["n"], r["k"], r["m"]) for r in result["rows"]}
    for kernel in ("w4a16", "w8a16"):
        entries = mine.setdefault(kernel, [])
        for shape, n, k, m in sorted(cases, key=lambda c: (c[0], c[3])):
            best = best_rows(result["rows"], shape, m, kernel)
            if not best:
                continue
            r = best[0]
            entry = dict(n=n, k=k, m=m, config=r["config"], us=round(r["us"], 2), gbs=round(r["gbs"]))
            if kernel == "w4a16":
                entry["group"] = result["group"]
            entries[:] = [e for e in entries if not (e["n"] == n and e["k"] == k and e["m"] == m
                                                     and e.get("group") == entry.get("group"))]
            entries.append(entry)
        entries.sort(key=lambda e: (e["n"], e["k"], e.get("group", 0), e["m"]))
    with open(path, "w") as f:
        f.write(format_table(table))
    return table


def format_table(table: dict) -> str:
    """JSON with one entry a line: a re-tuned GPU shows in a diff as the lines that changed."""
    parts = []
    for device, kernels in sorted(table.items()):
        inner = []
        for kernel, entries in sorted(kernels.items()):
            lines = ",\n".join("   " + json.dumps(e) for e in entries)
            inner.append(f'  {json.dumps(kernel)}: [\n{lines}\n  ]')
        parts.append(f' {json.dumps(device)}: {{\n' + ",\n".join(inner) + "\n }")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def main(argv=None):
    args = parse_args(argv)
    import torch
    if args.smoke and not torch.cuda.is_available():
        # Before any kernel module is imported: @triton.jit reads it when a kernel is defined.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    result = run(args)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "quant_gemv_sweep.json"), "w") as f:
            json.dump(result, f, indent=1)
    if args.table is not None:
        from rooflm.kernels.tuned_configs import TABLE_PATH
        path = args.table or TABLE_PATH
        merge_table(result, path)
        print(f"tile table: {path} ({result['device']})")
    return result


if __name__ == "__main__":
    main()
