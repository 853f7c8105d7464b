"""Instructions per weight of the weight-only kernels' main loops, from sm_90 SASS compiled on a CPU.

Why
---
At batch 1 a 4-bit GEMV reads ~6e12 weights/s at 3 TB/s; an H100 issues 4 warp-instructions a
clock per SM, 132 SMs x 4 x 32 lanes x ~1.98 GHz = ~33e12 lane-instructions/s, so a kernel that
spends more than ~5 instructions of a thread per weight cannot reach the bandwidth whatever its
tiles. Triton compiles to a cubin without a GPU (its bundled ptxas); this tool compiles the
weight-only kernels and their sweep candidates for sm_90, finds each kernel's main loop
(its largest backward branch) in the SASS, and prints the instructions a thread issues per weight
it handles there, the op mix, shared memory, and the issue-bound ceiling that count implies
(bytes of the format per second). A static count, not a timing: latency, memory stalls and the
loop's prologue are not in it; it says which kernels cannot be fast, not which are.

Usage: python benchmarks/quant_gemv_sass.py [--clock-ghz 1.98] [--sms 132] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import os
import re
import subprocess
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compile for real, even beside the CPU tests' setting
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
DIVISIBLE = ("N", "K", "S", "CHUNK", "stride_xm", "stride_ym")  # true of the Llama-3-8B shapes


def compile_kernel(fn, pointer_types: dict, constexprs: dict, num_warps: int, num_stages: int):
    """fn (a @triton.jit kernel) for sm_90 with the given pointer element types and constexprs;
    other arguments are i32, pointers and DIVISIBLE integers marked 16-divisible (as the launch
    on the 8B shapes specializes them)."""
    sig, attrs = {}, {}
    # constexprs the caller leaves out take their defaults (PDL = False: a launch option)
    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.default is not inspect.Parameter.empty},
                  **constexprs}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*" + pointer_types[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
            if name in DIVISIBLE:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, constexprs, attrs)
    return triton.compile(src, target=TARGET, options=dict(num_warps=num_warps, num_stages=num_stages))


def cuobjdump(kernel, flag: str) -> str:
    """`cuobjdump FLAG` (Triton's bundled copy) of a compiled kernel's cubin: -sass, -res-usage."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    path = f"/tmp/rooflm_sass_{os.getpid()}.cubin"
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    try:
        return subprocess.run([os.path.join(bin_dir, "cuobjdump"), flag, path],
                              capture_output=True, text=True, check=True).stdout
    finally:
        os.remove(path)


def main_loop(kernel) -> tuple[int, collections.Counter]:
    """(instructions, op counts) of the largest backward-branch loop in the kernel's SASS."""
    sass = cuobjdump(kernel, "-sass")
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    best = (0, collections.Counter())
    for addr, text in ins:
        m = re.search(r"BRA\s.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            if len(body) > best[0]:
                ops = collections.Counter(re.match(r"(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", t).group(1) for t in body)
                best = (len(body), ops)
    return best


def cases(group: int = 128):
    """(label, kernel fn, pointer types, constexprs, warps, stages, weights a step, bytes a weight)."""
    import rooflm.envs as envs
    from rooflm.kernels import w4a16 as new4, w8a16 as new8
    act = dict(y_ptr="bf16", x_ptr="bf16", xs_ptr="fp32", s_ptr="bf16", z_ptr="bf16", ws_ptr="fp32", count_ptr="i32")
    out = []
    from quant_gemv_sweep import w4_candidates, w8_candidates
    seen = set()
    for m in (1, 16, 64):
        for c in [new4.pick_config(m, 4096, 4096, group)] + w4_candidates(m, group):
            key = ("w4", c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages, c.fold)
            if key in seen:
                continue
            seen.add(key)
            out.append((f"w4a16 new M={m} {c}", new4._w4a16_kernel, dict(act, qw_ptr="u8"),
                        dict(GROUP=group, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_H=c.block_k // 2,
                             SPLIT=c.split_k > 1, EVEN=True, PRECISION="tf32", STAGES=c.num_stages,
                             FOLD=bool(c.fold), SWAP_AB=bool(c.swap_ab), XS=bool(c.x_sums),
                             FUSED=c.split_k > 1 and envs.get("ROOFLM_W4_FUSED_REDUCE")),
                        c.num_warps, c.num_stages, c.block_n * c.block_k, 0.5))
        for c in [new8.pick_config(m, 4096, 4096)] + w8_candidates(m):
            key = ("w8", c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages)
            if key in seen:
                continue
            seen.add(key)
            out.append((f"w8a16 new M={m} {c}", new8._w8a16_kernel, dict(act, qw_ptr="i8"),
                        dict(HAS_ZERO=False, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
                             SPLIT=c.split_k > 1, EVEN_K=True, PRECISION="tf32", STAGES=c.num_stages),
                        c.num_warps, c.num_stages, c.block_n * c.block_k, 1.0))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clock-ghz", type=float, default=1.98, help="SM clock (H100 SXM boost 1.98)")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--only", default=None, help="substring of the labels to compile")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    lanes_per_s = args.sms * 4 * 32 * args.clock_ghz * 1e9
    rows = []
    print(f"sm_90 SASS, Triton {triton.__version__}; issue bound = {args.sms} SMs x 4 x 32 lanes x "
          f"{args.clock_ghz} GHz / (instructions a thread issues per weight)")
    for label, fn, ptrs, const, warps, stages, weights_per_step, bytes_per_weight in cases():
        if args.only and args.only not in label:
            continue
        try:
            kernel = compile_kernel(fn, ptrs, const, warps, stages)
        except Exception as e:  # a config that does not compile (shared memory, registers)
            print(f"{label}: does not compile: {str(e).splitlines()[0][:120]}")
            rows.append(dict(label=label, error=str(e)[:300]))
            continue
        n_instr, ops = main_loop(kernel)
        per_weight = n_instr / (weights_per_step / (32 * warps))
        bound = lanes_per_s / per_weight * bytes_per_weight / 1e9
        top = ", ".join(f"{o} {c}" for o, c in ops.most_common(8))
        print(f"{label}\n    smem {kernel.metadata.shared:6d} B  loop {n_instr:5d} instr  {per_weight:5.2f} / weight "
              f"-> issue bound {bound:5.0f} GB/s   [{top}]")
        rows.append(dict(label=label, shared=kernel.metadata.shared, loop_instructions=n_instr,
                         per_weight=per_weight, issue_bound_gbs=bound, ops=dict(ops)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(triton=triton.__version__, clock_ghz=args.clock_ghz, sms=args.sms, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
