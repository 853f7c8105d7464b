"""Kernel benchmarks: rooflm's Triton kernels next to the device's ceilings and torch's best attention.

One run on one GPU measures, side by side:
  * the device's ceilings: a large device-to-device copy (GB/s, bytes read +
    written) and a large bf16 matmul (TFLOP/s);
  * torch scaled_dot_product_attention with its FLASH_ATTENTION and
    CUDNN_ATTENTION backends (prefill, contiguous q/k/v) and its default
    backend for decode (contiguous K/V, for context);
  * rooflm's prefill attention (TFLOP/s) and paged decode attention (GB/s of
    K/V read) over a paged cache, and the fused RMSNorm, RoPE + KV-write and
    SiLU-and-mul kernels (GB/s of the bytes they must move);
and prints the ratios against the issue's targets, then writes JSON and a
markdown table to benchmarks/results/ with the date, GPU and commit.

Timing: triton.testing.do_bench (CUDA events, L2 flushed before each call,
warm-up excluded), median of the repeats. Inputs are random, never zeros.

    python benchmarks/kernels.py                  # the benchmark (needs a GPU)
    python benchmarks/kernels.py --sweep          # + tile-config sweep for prefill and decode
    python benchmarks/kernels.py --compile-report # registers/spills for sm_90, no GPU needed
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

DEVICE = "cuda"
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# The targets, as ratios measured in the same run.
TARGETS = {
    "prefill_vs_flash": 1.5,
    "prefill_vs_cudnn": 0.85,
    "decode_batch_vs_copy": 0.90,   # 32+ sequences of 2k-4k tokens
    "decode_single_vs_copy": 0.80,  # one sequence of 8k tokens
    "elementwise_vs_copy": 0.85,
}


def bench_ms(fn, rep_ms: int = 200) -> float:
    """Median time of fn in ms (do_bench: events, L2 flush, warm-up excluded)."""
    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


def bench_graph_ms(fns: list, rep_ms: int = 100) -> float:
    """Median time per call of a CUDA graph of many calls, cycling through fns.

    For short kernels (decode, one-token steps) the launch cost of Python would
    otherwise be timed; the engine replays decode as CUDA graphs too. Each
    function of fns works on its own inputs, so with enough of them the data
    does not stay in L2 between calls.
    """
    state = {"i": 0}

    def step():
        fns[state["i"] % len(fns)]()
        state["i"] += 1

    return triton.testing.do_bench_cudagraph(step, rep=rep_ms, return_mode="median")


L2_BYTES = 50 * 2**20


def sets_to_defeat_l2(nbytes: int) -> int:
    """How many copies of a working set make each call read from HBM, not L2."""
    return min(16, max(1, math.ceil(3 * L2_BYTES / max(nbytes, 1))))


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def git_commit() -> str:
    if os.environ.get("ROOFLM_COMMIT"):
        return os.environ["ROOFLM_COMMIT"]
    try:
        root = os.path.dirname(RESULTS_DIR)
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True,
                               text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except Exception:  # noqa: BLE001 - no git on the device machine
        return "unknown"


# --------------------------------------------------------------------------
# Ceilings
# --------------------------------------------------------------------------

def measure_ceilings() -> dict:
    n_bytes = 1 << 30
    src = torch.randn(n_bytes // 2, dtype=torch.bfloat16, device=DEVICE)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    copy_gbs = 2 * n_bytes / ms / 1e6
    del src, dst
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=DEVICE)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=DEVICE)
    ms = bench_ms(lambda: a @ b)
    mm_tflops = 2 * n ** 3 / ms / 1e9
    return {"copy_GBps": copy_gbs, "bf16_matmul_TFLOPs": mm_tflops}


# --------------------------------------------------------------------------
# Prefill
# --------------------------------------------------------------------------

def causal_flops(batch: int, heads: int, seq: int, head_dim: int) -> float:
    """The convention of FlashAttention's benchmarks: half of the 4 * B * H * S^2 * D of full attention."""
    return 4 * batch * heads * seq * seq * head_dim / 2


def sdpa_prefill(batch, heads, kv_heads, seq, head_dim, dtype) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    q = torch.randn(batch, heads, seq, head_dim, dtype=dtype, device=DEVICE)
    k = torch.randn(batch, kv_heads, seq, head_dim, dtype=dtype, device=DEVICE)
    v = torch.randn(batch, kv_heads, seq, head_dim, dtype=dtype, device=DEVICE)
    flops = causal_flops(batch, heads, seq, head_dim)
    out = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        # GQA natively where the backend takes it, else with K/V heads expanded (noted).
        for mode in ("gqa", "expanded"):
            try:
                if mode == "gqa":
                    def fn():
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                else:
                    ke = k.repeat_interleave(heads // kv_heads, dim=1)
                    ve = v.repeat_interleave(heads // kv_heads, dim=1)

                    def fn():
                        return F.scaled_dot_product_attention(q, ke, ve, is_causal=True)
                with sdpa_kernel([backend]):
                    fn()
                    sync()
                    ms = bench_ms(fn)
                out[name] = {"ms": ms, "TFLOPs": flops / ms / 1e9, "kv": mode}
                break
            except Exception as e:  # noqa: BLE001 - a backend may refuse a shape; say so
                out[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    return out


def rooflm_prefill(batch, heads, kv_heads, seq, head_dim, dtype, block_size, config=None, use_tma=None,
                   check=True, ablate=0, warp_spec=False) -> dict:
    from rooflm.kernels.prefill_attention import prefill_attention, prefill_attention_ref, prefill_config
    from tests.kernels.helpers import random_paged_batch, rel_error

    meta, k_cache, v_cache = random_paged_batch([seq] * batch, [seq] * batch, kv_heads, head_dim, block_size,
                                                dtype, DEVICE, poison_unused=False)
    q = torch.randn(batch * seq, heads, head_dim, dtype=dtype, device=DEVICE)
    out = torch.empty_like(q)
    scale = head_dim ** -0.5

    def fn():
        return prefill_attention(q, k_cache, v_cache, meta, scale, out=out, config=config, use_tma=use_tma,
                                 _ablate=ablate, _warp_spec=warp_spec)

    fn()
    sync()
    ms = bench_ms(fn)
    tma = use_tma if use_tma is not None else block_size >= prefill_config(head_dim, heads // kv_heads, dtype)[1]
    res = {"ms": ms, "TFLOPs": causal_flops(batch, heads, seq, head_dim) / ms / 1e9,
           "config": list(config or prefill_config(head_dim, heads // kv_heads, dtype, tma=tma)),
           "block_size": block_size, "use_tma": tma}
    if check:
        # Spot-check one sequence against the reference (full check lives in the tests).
        one = type(meta)(slot_mapping=meta.slot_mapping[:seq], query_start_loc=meta.query_start_loc[:2],
                         seq_lens=meta.seq_lens[:1], block_tables=meta.block_tables[:1], max_query_len=seq,
                         max_seq_len=seq, num_decodes=0, query_start_loc_cpu=meta.query_start_loc_cpu[:2],
                         seq_lens_cpu=meta.seq_lens_cpu[:1])
        ref = prefill_attention_ref(q[:seq], k_cache, v_cache, one, scale)
        res["rel_error"] = rel_error(out[:seq], ref)
    return res


# --------------------------------------------------------------------------
# Decode
# --------------------------------------------------------------------------

def sdpa_decode(seq_lens, heads, kv_heads, head_dim, dtype) -> dict:
    import torch.nn.functional as F

    if len(set(seq_lens)) != 1:
        return {"error": "contiguous SDPA needs equal lengths"}
    batch, seq = len(seq_lens), seq_lens[0]
    kv_bytes = 2 * batch * seq * kv_heads * head_dim * torch.finfo(dtype).bits // 8
    fns = []
    for _ in range(sets_to_defeat_l2(kv_bytes)):
        q = torch.randn(batch, heads, 1, head_dim, dtype=dtype, device=DEVICE)
        k = torch.randn(batch, kv_heads, seq, head_dim, dtype=dtype, device=DEVICE)
        v = torch.randn(batch, kv_heads, seq, head_dim, dtype=dtype, device=DEVICE)
        fns.append(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    try:
        ms = bench_graph_ms(fns)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    return {"ms": ms, "GBps": kv_bytes / ms / 1e6}


def rooflm_decode(seq_lens, heads, kv_heads, head_dim, dtype, block_size, config=None, num_splits=None,
                  check=True, graph=True) -> dict:
    """Decode over a paged cache; timed as CUDA-graph replays over enough copies to miss L2."""
    from rooflm.kernels.decode_attention import (decode_attention, decode_attention_ref, decode_config,
                                                 decode_kv_bytes, decode_num_splits)
    from tests.kernels.helpers import random_paged_batch, rel_error

    scale = head_dim ** -0.5
    batches = []
    first = None
    kv_bytes = 0
    while not batches or len(batches) < sets_to_defeat_l2(kv_bytes):
        meta, k_cache, v_cache = random_paged_batch(seq_lens, [1] * len(seq_lens), kv_heads, head_dim,
                                                    block_size, dtype, DEVICE, poison_unused=False)
        q = torch.randn(len(seq_lens), heads, head_dim, dtype=dtype, device=DEVICE)
        out = torch.empty_like(q)
        kv_bytes = decode_kv_bytes(meta, kv_heads, head_dim, q.element_size())
        batches.append(lambda q=q, k=k_cache, v=v_cache, m=meta, o=out: decode_attention(
            q, k, v, m, scale, out=o, config=config, num_splits=num_splits))
        first = first or (q, k_cache, v_cache, meta, out)
    for fn in batches:
        fn()
    sync()
    ms_flush = bench_ms(batches[0])
    ms = bench_graph_ms(batches) if graph else ms_flush
    splits = num_splits or decode_num_splits(len(seq_lens), kv_heads, max(seq_lens))
    res = {"ms": ms, "GBps": kv_bytes / ms / 1e6, "GBps_eager_l2_flushed": kv_bytes / ms_flush / 1e6,
           "kv_MB": kv_bytes / 1e6, "block_size": block_size, "copies": len(batches),
           "config": list(config or decode_config(head_dim, dtype, math.ceil(max(seq_lens) / splits))),
           "num_splits": splits}
    if check:
        q, k_cache, v_cache, meta, out = first
        res["rel_error"] = rel_error(out, decode_attention_ref(q, k_cache, v_cache, meta, scale))
    return res


# --------------------------------------------------------------------------
# Elementwise kernels
# --------------------------------------------------------------------------

def rooflm_elementwise(dtype, tokens: int = 16384, hidden: int = 4096, tokens_mlp: int = 8192,
                       inter: int = 14336) -> list[dict]:
    from rooflm.kernels.rmsnorm import rmsnorm, rmsnorm_bytes, rmsnorm_ref
    from rooflm.kernels.rope_kv_write import rope_kv_write, rope_kv_write_bytes, rotate_ref
    from rooflm.kernels.silu_mul import silu_mul, silu_mul_bytes, silu_mul_ref
    from tests.kernels.helpers import rel_error

    rows = []
    x = torch.randn(tokens, hidden, dtype=dtype, device=DEVICE)
    r = torch.randn(tokens, hidden, dtype=dtype, device=DEVICE)
    w = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    for with_res in (False, True):
        fn = (lambda: rmsnorm(x, w, 1e-6, r)) if with_res else (lambda: rmsnorm(x, w, 1e-6))
        ms = bench_ms(fn)
        nbytes = rmsnorm_bytes(tokens, hidden, x.element_size(), with_res)
        got = fn()
        ref = rmsnorm_ref(x, w, 1e-6, r if with_res else None)
        err = rel_error(got[0], ref[0]) if with_res else rel_error(got, ref)
        rows.append({"kernel": "rmsnorm" + ("+residual" if with_res else ""), "shape": f"{tokens}x{hidden}",
                     "ms": ms, "GBps": nbytes / ms / 1e6, "rel_error": err})
    del x, r

    heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=DEVICE)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(tokens, heads, head_dim)
    k = k.view(tokens, kv_heads, head_dim)
    v = v.view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 8192, (tokens,), device=DEVICE)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim))
    freqs = torch.arange(8192, device=DEVICE).float()[:, None] * inv_freq[None, :]
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    num_blocks = tokens // block_size + 8
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    slot_mapping = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    q0 = q.clone()
    ms = bench_ms(lambda: rope_kv_write(q, k, v, positions, table, k_cache, v_cache, slot_mapping))
    # q was rotated many times in place: check one fresh call.
    q.copy_(q0)
    rope_kv_write(q, k, v, positions, table, k_cache, v_cache, slot_mapping)
    err = rel_error(q, rotate_ref(q0, positions, table))
    nbytes = rope_kv_write_bytes(tokens, heads, kv_heads, head_dim, q.element_size())
    rows.append({"kernel": "rope_kv_write", "shape": f"T={tokens} H={heads}/{kv_heads} D={head_dim}",
                 "ms": ms, "GBps": nbytes / ms / 1e6, "rel_error": err})
    del qkv, k_cache, v_cache

    x = torch.randn(tokens_mlp, 2 * inter, dtype=dtype, device=DEVICE)
    ms = bench_ms(lambda: silu_mul(x))
    rows.append({"kernel": "silu_mul", "shape": f"{tokens_mlp}x{inter}", "ms": ms,
                 "GBps": silu_mul_bytes(tokens_mlp, inter, x.element_size()) / ms / 1e6,
                 "rel_error": rel_error(silu_mul(x), silu_mul_ref(x))})
    return rows


# --------------------------------------------------------------------------
# Compiler resource report (registers, spills, shared memory)
# --------------------------------------------------------------------------

def loaded_kernel_resources() -> list[dict]:
    """Registers/spills/shared memory of every kernel variant compiled in this process."""
    from rooflm.kernels import decode_attention, prefill_attention, rmsnorm, rope_kv_write, silu_mul

    fns = [prefill_attention._prefill_attention_kernel, decode_attention._decode_attention_kernel,
           decode_attention._decode_reduce_kernel, rope_kv_write._rope_kv_write_kernel,
           rmsnorm._rmsnorm_kernel, silu_mul._silu_mul_kernel]
    rows = []
    for fn in fns:
        for entry in getattr(fn, "device_caches", {}).values():
            cache = entry[0] if isinstance(entry, tuple) else entry
            for kernel in cache.values():
                try:
                    kernel._init_handles()
                    consts = {k: v for k, v in getattr(kernel.src, "constants", {}).items()} \
                        if hasattr(kernel, "src") else {}
                    rows.append({"kernel": kernel.name, "n_regs": kernel.n_regs, "n_spills": kernel.n_spills,
                                 "shared": kernel.metadata.shared, "num_warps": kernel.metadata.num_warps,
                                 "num_stages": kernel.metadata.num_stages, "constants": str(consts)[:300]})
                except Exception as e:  # noqa: BLE001 - best effort across Triton versions
                    rows.append({"kernel": getattr(kernel, "name", "?"), "error": str(e)[:120]})
    return rows


def compile_report() -> list[dict]:
    """Compile the attention kernels for sm_90 on this machine (no GPU) and read ptxas's resource usage."""
    from triton.backends.compiler import GPUTarget
    from rooflm.kernels.decode_attention import _decode_attention_kernel
    from rooflm.kernels.prefill_attention import PREFILL_CONFIGS_TMA, _prefill_attention_kernel
    from rooflm.kernels.decode_attention import DECODE_CONFIGS

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")

    def build(fn, signature, constexprs, num_warps, num_stages):
        sig = dict(signature, **{k: "constexpr" for k in constexprs})
        # Pointers and strides are 16-divisible at run time (the JIT specialises on it).
        attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
                 if name in signature and (signature[name].startswith("*") or name.startswith("stride"))}
        src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": num_warps, "num_stages": num_stages})
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True).stdout
        sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "--dump-sass", f.name],
                              capture_output=True, text=True).stdout
        os.unlink(f.name)
        regs = re.search(r"REG:(\d+)", usage)
        stack = re.search(r"STACK:(\d+)", usage)
        return {"regs": int(regs.group(1)) if regs else None, "stack": int(stack.group(1)) if stack else None,
                "smem": compiled.metadata.shared,
                **{op: len(re.findall(op, sass)) for op in ("HGMMA", "HMMA", "LDGSTS", "UTMALDG", "LDL", "STL")}}

    rows = []
    dt = "bf16"
    base = dict(out_ptr=f"*{dt}", q_ptr=f"*{dt}", k_cache_ptr=f"*{dt}", v_cache_ptr=f"*{dt}",
                block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_loc_ptr="*i32")
    strides = dict(stride_qt="i32", stride_qh="i32", stride_ot="i32", stride_oh="i32", stride_cb="i32",
                   stride_ct="i32", stride_ch="i32", stride_bt="i32")
    for d_pad, (bm, bn, warps, stages) in PREFILL_CONFIGS_TMA.items():
        for use_tma in (False, True):
            desc = f"tensordesc<{dt}[{bn},{d_pad}]>" if use_tma else f"*{dt}"
            sig = dict(base, k_desc=desc, v_desc=desc, seq_lo="i32", seq_hi="i32", tile_lo="i32",
                       num_tiles="i32", qk_scale="fp32", sliding_window="i32", **strides)
            ce = dict(GROUP=4, GROUP_PAD=4, HEAD_DIM=d_pad, HEAD_DIM_PAD=d_pad, BLOCK_SIZE=128, BLOCK_M=bm,
                      BLOCK_N=bn, SLIDING=False, UPCAST=False, DOT_PRECISION="tf32", USE_TMA=use_tma, ABLATE=0)
            rows.append({"kernel": "prefill", "head_dim": d_pad, "config": [bm, bn, warps, stages],
                         "use_tma": use_tma, **build(_prefill_attention_kernel, sig, ce, warps, stages)})
    for d_pad, (bn, warps, stages) in DECODE_CONFIGS.items():
        sig = dict(base, part_out_ptr="*fp32", part_lse_ptr="*fp32", qk_scale="fp32", sliding_window="i32",
                   num_splits="i32", **strides)
        ce = dict(NUM_HEADS=32, GROUP=4, ROWS=16, HEAD_DIM=d_pad, HEAD_DIM_PAD=d_pad, BLOCK_SIZE=16, BLOCK_N=bn,
                  SINGLE_SPLIT=False, SLIDING=False, UPCAST=False, DOT_PRECISION="tf32")
        rows.append({"kernel": "decode", "head_dim": d_pad, "config": [bn, warps, stages], "use_tma": False,
                     **build(_decode_attention_kernel, sig, ce, warps, stages)})
    return rows


# --------------------------------------------------------------------------
# Sweep of tile configs (to choose the tables in the kernel files)
# --------------------------------------------------------------------------

PREFILL_SWEEP = [(128, 64, 4, 3), (128, 64, 4, 2), (128, 64, 4, 4), (128, 32, 4, 3), (128, 32, 4, 4),
                 (256, 64, 8, 2), (256, 64, 8, 3), (256, 32, 8, 3), (128, 128, 4, 2)]
DECODE_SWEEP = {
    # shape: (seq_lens, configs, split counts)
    "32x4096": ([4096] * 32, [(64, 4, 3), (128, 4, 3), (128, 4, 4), (128, 8, 3)], [1, 2]),
    "32x2k-4k": (None, [(64, 4, 3), (128, 4, 3), (128, 8, 3)], [1, 2, 3]),
    "1x8192": ([8192], [(32, 4, 3), (32, 4, 4), (64, 4, 3), (16, 4, 4)], [16, 32, 64, 128]),
}


def sweep(dtype) -> dict:
    out = {"prefill": [], "decode": []}
    for seq, batch in ((2048, 8), (8192, 2)):
        for config in PREFILL_SWEEP:
            for use_tma in (True,):
                try:
                    r = rooflm_prefill(batch, 32, 8, seq, 128, dtype, 128, config=config, use_tma=use_tma,
                                       check=False)
                except Exception as e:  # noqa: BLE001 - an invalid config (e.g. shared memory) is skipped
                    r = {"error": f"{type(e).__name__}: {str(e)[:160]}", "config": list(config),
                         "use_tma": use_tma}
                r.update(seq=seq, batch=batch)
                out["prefill"].append(r)
                print(f"sweep prefill S={seq} {config} tma={use_tma}: "
                      f"{r.get('TFLOPs', float('nan')):.0f} TFLOP/s {r.get('error', '')}", flush=True)
    for name, (lens, configs, split_counts) in DECODE_SWEEP.items():
        lens = lens or mixed_lengths(32, 0)
        for config in configs:
            for num_splits in split_counts:
                try:
                    r = rooflm_decode(lens, 32, 8, 128, dtype, 16, config=config, num_splits=num_splits,
                                      check=False)
                except Exception as e:  # noqa: BLE001
                    r = {"error": f"{type(e).__name__}: {str(e)[:160]}", "config": list(config)}
                r.update(shape=name, num_splits=num_splits)
                out["decode"].append(r)
                print(f"sweep decode {name} {config} splits={num_splits}: "
                      f"{r.get('GBps', float('nan')):.0f} GB/s {r.get('error', '')}", flush=True)
    return out


class _NoLaunch:
    """Stands in for a Triton kernel whose launch an experiment leaves out."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def experiments(dtype, copy_gbps: float) -> list[dict]:
    """Variants that drop one stage, to see what limits the kernels that miss their targets."""
    from rooflm.kernels import decode_attention as da

    rows = []
    for seq, batch in ((2048, 8), (8192, 2)):
        base = rooflm_prefill(batch, 32, 8, seq, 128, dtype, 128, check=False)["TFLOPs"]
        for what, kwargs in (("full kernel (default config, TMA)", {}),
                             ("pointer loads instead of TMA", {"use_tma": False}),
                             ("no exp2 on the score tile (MUFU dropped)", {"ablate": 1}),
                             ("no rescale of the accumulator", {"ablate": 2})):
            t = base if not kwargs else rooflm_prefill(batch, 32, 8, seq, 128, dtype, 128, check=False,
                                                       **kwargs)["TFLOPs"]
            rows.append({"kernel": "prefill", "shape": f"B={batch} S={seq}", "variant": what,
                         "value": t, "unit": "TFLOP/s (same FLOP count)"})
    full = rooflm_decode([8192], 32, 8, 128, dtype, 16, check=False)
    rows.append({"kernel": "decode", "shape": "1 x 8192", "variant": f"full ({full['num_splits']} splits + reduce)",
                 "value": full["ms"] * 1e3, "unit": "us"})
    saved = da._decode_reduce_kernel
    da._decode_reduce_kernel = _NoLaunch()
    try:
        no_reduce = rooflm_decode([8192], 32, 8, 128, dtype, 16, check=False)
    finally:
        da._decode_reduce_kernel = saved
    rows.append({"kernel": "decode", "shape": "1 x 8192", "variant": "split kernel alone (reduce not launched)",
                 "value": no_reduce["ms"] * 1e3, "unit": "us"})
    one = rooflm_decode([8192], 32, 8, 128, dtype, 16, check=False, num_splits=1)
    rows.append({"kernel": "decode", "shape": "1 x 8192", "variant": "one split (8 programs, no reduce)",
                 "value": one["ms"] * 1e3, "unit": "us"})
    x = torch.zeros(1, device=DEVICE)
    rows.append({"kernel": "decode", "shape": "-", "variant": "floor: one tiny kernel per graph node",
                 "value": bench_graph_ms([lambda: x.add_(1)]) * 1e3, "unit": "us"})
    floor_us = full["kv_MB"] / copy_gbps * 1e3
    rows.append({"kernel": "decode", "shape": "1 x 8192", "variant": "floor: K/V bytes at copy bandwidth",
                 "value": floor_us, "unit": "us"})
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


def mixed_lengths(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(2048, 4097, (n,), generator=gen).tolist()


def profile(target: str, dtype) -> None:
    """Run one kernel a few times, for `ncu --clock-control none -k regex:<kernel>` to pick up."""
    if target == "prefill":
        rooflm_prefill(8, 32, 8, 2048, 128, dtype, 128, check=False)
    elif target == "prefill-bs16":
        rooflm_prefill(8, 32, 8, 2048, 128, dtype, 16, check=False)
    elif target == "decode":
        rooflm_decode([8192], 32, 8, 128, dtype, 16, check=False, graph=False)
    elif target == "decode-batch":
        rooflm_decode(mixed_lengths(32, 0), 32, 8, 128, dtype, 16, check=False, graph=False)
    else:
        raise SystemExit(f"unknown profile target {target}")


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------

def fmt(x, digits=0):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="also sweep tile configs (slow)")
    parser.add_argument("--compile-report", action="store_true",
                        help="compile for sm_90 here and print registers/spills (no GPU needed)")
    parser.add_argument("--out-dir", default=RESULTS_DIR)
    parser.add_argument("--tag", default="", help="suffix of the result file names")
    parser.add_argument("--profile", choices=["prefill", "prefill-bs16", "decode", "decode-batch"],
                        help="only run one kernel a few times (for ncu)")
    args = parser.parse_args()

    if args.compile_report:
        for row in compile_report():
            print(json.dumps(row))
        return
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py needs a CUDA GPU (try --compile-report on a CPU machine)")
    if args.profile:
        profile(args.profile, torch.bfloat16)
        return

    dtype = torch.bfloat16
    props = torch.cuda.get_device_properties(0)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": props.name, "sms": props.multi_processor_count, "commit": git_commit(),
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "dtype": str(dtype), "timing": "triton.testing.do_bench median, L2 flushed, warm-up excluded",
    }
    print(f"{props.name}  torch {torch.__version__}  triton {triton.__version__}  commit {result['commit']}",
          flush=True)
    result["ceilings"] = measure_ceilings()
    copy = result["ceilings"]["copy_GBps"]
    print(f"ceilings: copy {copy:.0f} GB/s, bf16 matmul {result['ceilings']['bf16_matmul_TFLOPs']:.0f} TFLOP/s",
          flush=True)

    if args.sweep:
        result["sweep"] = sweep(dtype)

    result["prefill"] = []
    for seq, batch in ((2048, 8), (8192, 2)):
        row = {"shape": f"B={batch} S={seq} H=32/8 D=128 causal", "seq": seq, "batch": batch,
               "torch": sdpa_prefill(batch, 32, 8, seq, 128, dtype)}
        for block_size in (16, 128):
            row[f"rooflm_bs{block_size}"] = rooflm_prefill(batch, 32, 8, seq, 128, dtype, block_size)
        result["prefill"].append(row)
        print(json.dumps(row), flush=True)

    result["decode"] = []
    mixed32 = mixed_lengths(32, 0)
    mixed64 = mixed_lengths(64, 1)
    for name, lens, target in (("32 x 4096", [4096] * 32, "batch"), ("32 x 2k-4k", mixed32, "batch"),
                               ("64 x 2k-4k", mixed64, "batch"), ("128 x 2048", [2048] * 128, "batch"),
                               ("1 x 8192", [8192], "single")):
        row = {"shape": name + " H=32/8 D=128", "target": target, "torch": sdpa_decode(lens, 32, 8, 128, dtype)}
        for block_size in (16, 128):
            row[f"rooflm_bs{block_size}"] = rooflm_decode(lens, 32, 8, 128, dtype, block_size)
        result["decode"].append(row)
        print(json.dumps(row), flush=True)

    result["experiments"] = experiments(dtype, copy)
    result["elementwise"] = rooflm_elementwise(dtype)
    for row in result["elementwise"]:
        print(json.dumps(row), flush=True)
    result["resources"] = loaded_kernel_resources()

    # Ratios against the targets.
    checks = []
    for row in result["prefill"]:
        for bs in (16, 128):
            ours = row[f"rooflm_bs{bs}"]["TFLOPs"]
            for ref, key in (("flash", "prefill_vs_flash"), ("cudnn", "prefill_vs_cudnn")):
                theirs = row["torch"].get(ref, {}).get("TFLOPs")
                ratio = ours / theirs if theirs else None
                checks.append({"what": f"prefill {row['shape']} bs={bs} vs torch {ref}", "ours": ours,
                               "theirs": theirs, "ratio": ratio, "target": TARGETS[key],
                               "met": ratio is not None and ratio >= TARGETS[key]})
    for row in result["decode"]:
        key = "decode_batch_vs_copy" if row["target"] == "batch" else "decode_single_vs_copy"
        for bs in (16, 128):
            ours = row[f"rooflm_bs{bs}"]["GBps"]
            checks.append({"what": f"decode {row['shape']} bs={bs} vs copy", "ours": ours, "theirs": copy,
                           "ratio": ours / copy, "target": TARGETS[key], "met": ours / copy >= TARGETS[key]})
    for row in result["elementwise"]:
        checks.append({"what": f"{row['kernel']} {row['shape']} vs copy", "ours": row["GBps"], "theirs": copy,
                       "ratio": row["GBps"] / copy, "target": TARGETS["elementwise_vs_copy"],
                       "met": row["GBps"] / copy >= TARGETS["elementwise_vs_copy"]})
    result["targets"] = checks

    os.makedirs(args.out_dir, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    gpu_tag = re.sub(r"[^A-Za-z0-9]+", "-", props.name).strip("-").lower()
    base = os.path.join(args.out_dir, f"kernels-{gpu_tag}-{stamp}{args.tag}")
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    md = markdown(result)
    with open(base + ".md", "w") as f:
        f.write(md)
    print(md)
    print(f"wrote {base}.json and {base}.md")


def markdown(result: dict) -> str:
    c = result["ceilings"]
    lines = [f"# Kernel benchmark: {result['gpu']}, {result['date']}", "",
             f"commit `{result['commit']}`, torch {result['torch']}, triton {result['triton']}, "
             f"{result['dtype']}; {result['timing']}.", "",
             f"Ceilings: device-to-device copy **{c['copy_GBps']:.0f} GB/s** (read + write), "
             f"bf16 matmul 8192^3 **{c['bf16_matmul_TFLOPs']:.0f} TFLOP/s**.", "",
             "## Prefill (TFLOP/s, causal FLOPs = 2 B H S^2 D)", "",
             "| shape | torch FLASH | torch cuDNN | rooflm bs=16 | rooflm bs=128 | rel. error |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in result["prefill"]:
        t = row["torch"]
        lines.append(f"| {row['shape']} | {fmt(t.get('flash', {}).get('TFLOPs'))} | "
                     f"{fmt(t.get('cudnn', {}).get('TFLOPs'))} | {fmt(row['rooflm_bs16']['TFLOPs'])} | "
                     f"{fmt(row['rooflm_bs128']['TFLOPs'])} | {row['rooflm_bs128'].get('rel_error', 0):.1e} |")
    lines += ["", "## Decode (GB/s of K/V read; paged cache; torch SDPA on contiguous K/V for context)", "",
              "| shape | torch SDPA | rooflm bs=16 | rooflm bs=128 | splits | % of copy (best) | rel. error |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in result["decode"]:
        best = max(row["rooflm_bs16"]["GBps"], row["rooflm_bs128"]["GBps"])
        lines.append(f"| {row['shape']} | {fmt(row['torch'].get('GBps'))} | {fmt(row['rooflm_bs16']['GBps'])} | "
                     f"{fmt(row['rooflm_bs128']['GBps'])} | {row['rooflm_bs16']['num_splits']} | "
                     f"{100 * best / c['copy_GBps']:.0f}% | {row['rooflm_bs16'].get('rel_error', 0):.1e} |")
    lines += ["", "## Fused elementwise kernels (GB/s of the bytes they must move)", "",
              "| kernel | shape | ms | GB/s | % of copy | rel. error |", "| --- | --- | --- | --- | --- | --- |"]
    for row in result["elementwise"]:
        lines.append(f"| {row['kernel']} | {row['shape']} | {row['ms']:.3f} | {row['GBps']:.0f} | "
                     f"{100 * row['GBps'] / c['copy_GBps']:.0f}% | {row['rel_error']:.1e} |")
    lines += ["", "## Targets (ratios in this run)", "", "| what | ours | reference | ratio | target | met |",
              "| --- | --- | --- | --- | --- | --- |"]
    for t in result["targets"]:
        lines.append(f"| {t['what']} | {fmt(t['ours'])} | {fmt(t['theirs'])} | {fmt(t['ratio'], 2)} | "
                     f"{t['target']} | {'yes' if t['met'] else '**no**'} |")
    if result.get("experiments"):
        lines += ["", "## Experiments: drop one stage to see what limits", "",
                  "| kernel | shape | variant | value | unit |", "| --- | --- | --- | --- | --- |"]
        for r in result["experiments"]:
            lines.append(f"| {r['kernel']} | {r['shape']} | {r['variant']} | {r['value']:.1f} | {r['unit']} |")
    if result.get("resources"):
        lines += ["", "## Compiled kernels (registers, spills, shared memory)", "",
                  "| kernel | regs | spills | shared | warps | stages |", "| --- | --- | --- | --- | --- | --- |"]
        for r in result["resources"]:
            if "error" not in r:
                lines.append(f"| {r['kernel']} | {r['n_regs']} | {r['n_spills']} | {r['shared']} | "
                             f"{r['num_warps']} | {r['num_stages']} |")
    if result.get("sweep"):
        lines += ["", "## Config sweep", "", "| kernel | shape | config | TMA / splits | result |",
                  "| --- | --- | --- | --- | --- |"]
        for r in result["sweep"]["prefill"]:
            lines.append(f"| prefill | S={r['seq']} B={r['batch']} | {r.get('config')} | {r.get('use_tma')} | "
                         f"{fmt(r.get('TFLOPs'))} TFLOP/s {r.get('error', '')} |")
        for r in result["sweep"]["decode"]:
            lines.append(f"| decode | {r['shape']} | {r.get('config')} | {r.get('num_splits')} | "
                         f"{fmt(r.get('GBps'))} GB/s {r.get('error', '')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
