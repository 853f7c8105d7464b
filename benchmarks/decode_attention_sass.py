"""Instructions per K/V element of the paged decode attention kernel's main loop, bf16 and FP8
caches, from sm_90 SASS compiled on a CPU.

Why
---
The FP8 KV decode kernel reads half the bytes of the bf16 one in about the same time on the H100
(`benchmarks/results/kv-fp8-h100-20261123/`): both run at about the same *elements* per second.
At 3 TB/s a bf16 cache streams 1.5e12 K/V elements a second and an FP8 one 3e12; an H100 issues
~33e12 lane-instructions a second (132 SMs x 4 x 32 lanes x 1.98 GHz), so a loop that spends more
than ~22 (bf16) or ~11 (FP8) instructions of a thread per element cannot reach the bandwidth.
This tool compiles `_decode_attention_kernel` for sm_90 (Triton's bundled ptxas, no GPU), finds
the main loop (the largest backward branch) in the SASS, and prints the instructions a thread
issues there per K/V element, the op mix and the issue-bound ceiling in GB/s of the cache's
format. A static count: memory latency and stalls are not in it; it says which variant cannot
be fast, and what its instructions are spent on.

Usage: python benchmarks/decode_attention_sass.py [--out FILE.json] [--only TEXT]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compile for real, even beside the CPU tests' setting
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from quant_gemv_sass import TARGET, cuobjdump, main_loop  # noqa: E402

FLOAT_ARGS = ("qk_scale",)
DIVISIBLE = ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_cb", "stride_ct", "stride_ch",
             "stride_bt")


def compile_decode(fp8: bool, block_n: int, num_warps: int, num_stages: int, ablate: int = 0, pairs: bool = False,
                   static: bool = False, block_size: int = 16):
    from rooflm.kernels.decode_attention import _decode_attention_kernel as fn

    kv = ("i16" if pairs else "fp8e4nv") if fp8 else "bf16"
    ptrs = dict(out_ptr="bf16", part_out_ptr="fp32", part_lse_ptr="fp32", q_ptr="bf16", k_cache_ptr=kv,
                v_cache_ptr=kv, k_scale_ptr="fp32", v_scale_ptr="fp32", block_tables_ptr="i32",
                seq_lens_ptr="i32", query_start_loc_ptr="i32")
    consts = dict(NUM_HEADS=32, GROUP=4, ROWS=16, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_SIZE=block_size,
                  BLOCK_N=block_n, SINGLE_SPLIT=True, SLIDING=False, UPCAST=False, DOT_PRECISION="tf32",
                  FP8=fp8, PDL=False, ABLATE=ablate, PAIRS=pairs, ONE_ENTRY=True, TOKEN_SCALES=not static)
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = "*" + ptrs[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in FLOAT_ARGS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name in DIVISIBLE:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=TARGET,
                          options=dict(num_warps=num_warps, num_stages=num_stages))


CASES = [  # (label, fp8, BLOCK_N, warps, stages, ablate[, pairs[, static scales, block size]])
    ("bf16, engine tiles (128, 4, 3)", False, 128, 4, 3, 0),
    ("bf16, short-range tiles (32, 4, 3)", False, 32, 4, 3, 0),
    ("fp8, engine tiles (128, 4, 3)", True, 128, 4, 3, 0),
    ("fp8, short-range tiles (32, 4, 3)", True, 32, 4, 3, 0),
    ("fp8, (64, 2, 4) (the H100 sweep's best)", True, 64, 2, 4, 0),
    ("fp8, no scales (ablate 1: wrong results)", True, 128, 4, 3, 1),
    ("fp8, V scales folded into p (ablate 2)", True, 128, 4, 3, 2),
    # Deeper pipelines and wider tiles: more FP8 bytes in flight per SM (candidates, not timed).
    ("fp8, (128, 4, 5)", True, 128, 4, 5, 0),
    ("fp8, (256, 4, 3)", True, 256, 4, 3, 0),
    ("fp8, (256, 8, 3)", True, 256, 8, 3, 0),
    # Byte pairs (utils.load_e4m3_pairs): 16-bit loads, one cvt for two values.
    ("fp8 pairs, engine tiles (64, 2, 6)", True, 64, 2, 6, 0, True),
    ("fp8 bytes, engine tiles (64, 2, 6)", True, 64, 2, 6, 0),
    ("fp8 pairs, (128, 4, 3)", True, 128, 4, 3, 0, True),
    ("fp8 pairs, (32, 4, 3) short range", True, 32, 4, 3, 0, True),
    # Static scales (one per KV head, --kv-cache-scales static), at the engine's block size 64.
    ("bf16, (128, 4, 3), block 64", False, 128, 4, 3, 0, False, False, 64),
    ("fp8 pairs per-token, (64, 2, 6), block 64", True, 64, 2, 6, 0, True, False, 64),
    ("fp8 pairs static, (64, 2, 6), block 64", True, 64, 2, 6, 0, True, True, 64),
    ("fp8 pairs static, (128, 4, 3), block 64", True, 128, 4, 3, 0, True, True, 64),
    ("fp8 pairs static, (32, 2, 8), block 64", True, 32, 2, 8, 0, True, True, 64),
    ("fp8 pairs static, (64, 4, 4), block 64", True, 64, 4, 4, 0, True, True, 64),
]
SM_REGISTERS, SM_SHARED, SM_MAX_WARPS = 65536, 228 * 1024, 64  # H100 per SM


def registers(kernel) -> int:
    """Registers a thread uses, from the cubin's resource usage (no GPU needed)."""
    return int(re.search(r"REG:(\d+)", cuobjdump(kernel, "-res-usage")).group(1))


def in_flight(kernel, num_warps: int) -> tuple[int, int, int]:
    """(registers a thread, CTAs resident per SM by registers, shared memory and warps, their
    shared bytes): the most K/V an SM can have on its way from memory, since the tiles land in
    shared memory."""
    n_regs = registers(kernel)
    regs = n_regs * 32 * num_warps
    smem = max(kernel.metadata.shared, 1)
    ctas = min(SM_REGISTERS // max(regs, 1), SM_SHARED // smem, SM_MAX_WARPS // num_warps)
    return n_regs, ctas, ctas * kernel.metadata.shared


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clock-ghz", type=float, default=1.98)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default="", help="only the cases whose label contains this text")
    args = ap.parse_args(argv)
    lanes_per_s = args.sms * 4 * 32 * args.clock_ghz * 1e9
    print(f"sm_90 SASS, Triton {triton.__version__}; Llama-3-8B decode shape (GQA 32/8, D 128, block 16); "
          f"issue bound = {args.sms} SMs x 4 x 32 lanes x {args.clock_ghz} GHz / instructions per element")
    rows = []
    for label, fp8, block_n, warps, stages, ablate, *extra in CASES:
        if args.only not in label:
            continue
        kernel = compile_decode(fp8, block_n, warps, stages, ablate, *extra)
        count, ops = main_loop(kernel)
        elements = 2 * block_n * 128  # K and V of one key tile, one KV head
        per_element = count * warps * 32 / elements
        gbs = lanes_per_s / per_element * (1 if fp8 else 2) / 1e9
        top = ", ".join(f"{op} {n}" for op, n in ops.most_common(8))
        n_regs, ctas, shared_per_sm = in_flight(kernel, warps)
        rows.append(dict(label=label, loop_instructions=count, per_element=per_element, issue_bound_gbs=gbs,
                         shared_bytes=kernel.metadata.shared, registers=n_regs, ctas_per_sm=ctas,
                         shared_per_sm=shared_per_sm, ops=dict(ops)))
        print(f"{label:42s} loop {count:4d} instr, {per_element:5.2f}/element -> issue bound {gbs:6.0f} GB/s; "
              f"{n_regs} regs, smem {kernel.metadata.shared // 1024} KB x {ctas} CTAs = "
              f"{shared_per_sm // 1024} KB an SM; {top}", flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"triton": triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
