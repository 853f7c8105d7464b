"""Small helpers shared by the Triton kernels.

Nothing here launches a kernel. The kernels run compiled on CUDA and under
Triton's interpreter (TRITON_INTERPRET=1) on the CPU; the few places where the
two must differ ask `is_interpreter()`.
"""

from __future__ import annotations

import functools
import os

from typing import Optional

import torch
import triton
import triton.language as tl

import rooflm.envs as envs

# 1 / ln(2): the kernels use exp2/log2, so the softmax scale is multiplied by it once.
LOG2E = 1.4426950408889634


def is_interpreter() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


try:  # Grid dependency control (Triton >= 3.5): the device side of programmatic dependent launch.
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _HAS_GDC = True
except ImportError:  # pragma: no cover - older Triton: kernels never take the PDL branch
    _HAS_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


@functools.lru_cache(maxsize=8)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


# Programmatic dependent launch for the decode-path kernels (gemv, RoPE/KV write, decode
# attention, the persistent matmul, RMSNorm, SiLU-mul); benchmarks switch it off to measure what
# it is worth (ROOFLM_PDL=0 for a whole run).


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: a kernel may start while the one before it drains and
    wait (gdc_wait) for its results. Hopper (sm_90) and later, compiled Triton only. A kernel
    launched this way must gdc_wait in every program before it reads what earlier kernels
    wrote or writes anything."""
    if not envs.cached.ROOFLM_PDL or device.type != "cuda" or not _HAS_GDC or is_interpreter():
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device())[0] >= 9


def pdl_launch(device: torch.device) -> dict:
    """Launch options of a kernel with a PDL constexpr that gdc_waits first: PDL where supported.

    Where a kernel releases its dependents matters: the weight-only GEMVs (w8a16, w4a16) releasing
    them at their start made batch-1 decode slower on the H100 (int8 291.8 -> 286.7, int4 282.8 ->
    263.3 tok/s with ROOFLM_PDL 0 -> 1 at da5c058): the next kernels sit resident, holding SM
    slots the GEMV's later waves need. Released after the main loop, int8 went 291.7 -> 303.5
    (3c3577e). W4A16 with its split-K sum in the kernel releases at each program's very end: after
    the main loop int4 batch 1 fell 296 -> 289 tok/s, at the end it rose to 313 (w4a16.py). Measure
    before adding it to a kernel."""
    return {"PDL": True, "launch_pdl": True} if pdl_supported(device) else {}


def next_power_of_2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


@functools.lru_cache(maxsize=8)
def num_sms(device_index: int = 0) -> int:
    """Streaming multiprocessors of the device; a small stand-in on the CPU.

    Split-KV decode sizes its grid from this. Under the interpreter the value
    only has to make the tests exercise more than one split.
    """
    if torch.cuda.is_available() and not is_interpreter():
        return torch.cuda.get_device_properties(device_index).multi_processor_count
    return 4


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision for fp32 inputs: plain tf32 would cost ~3e-4 of relative error.

    Compiled: tf32x3 (three tf32 products on the tensor cores, ~fp32 accuracy;
    "ieee" runs on the FMA units and spills). The interpreter computes in fp32
    anyway. fp16/bf16 inputs ignore the setting.
    """
    if dtype != torch.float32:
        return "tf32"
    return "ieee" if is_interpreter() else "tf32x3"


def upcast_dots(dtype: torch.dtype) -> bool:
    """Whether dot operands are upcast to fp32 inside the kernel.

    Triton 3.9's interpreter returns garbage for tl.dot on bf16 operands (bf16
    loads are fine), so in interpreter mode bf16 tiles are upcast before each
    dot. Compiled kernels never upcast.
    """
    return is_interpreter() and dtype == torch.bfloat16


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")


# --------------------------------------------------------------------------
# Paged-cache addressing shared by the two attention kernels
# --------------------------------------------------------------------------

@triton.jit
def load_2d(ptrs, row_ok, col_ok, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    """Load a tile, masking only what can be out of range (an unmasked load is cheapest)."""
    if MASK_ROWS:
        if MASK_COLS:
            x = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        else:
            x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    else:
        if MASK_COLS:
            x = tl.load(ptrs, mask=col_ok[None, :], other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def kv_tile_offsets(block_table_ptr, start_n, kv_ok, stride_b, stride_t,
                    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                    ONE_ENTRY_AT_EQUAL: tl.constexpr = True):
    """Element offsets [BLOCK_N] of keys start_n .. start_n + BLOCK_N - 1 in the paged cache.

    The key at position p lives in block block_table[p // BLOCK_SIZE], slot
    p % BLOCK_SIZE. start_n is a multiple of BLOCK_N. Keys where kv_ok is
    false (past the sequence) get a valid but meaningless offset; the caller
    masks their loads.
    """
    offs_n = tl.arange(0, BLOCK_N)
    if BLOCK_N < BLOCK_SIZE or (BLOCK_N == BLOCK_SIZE and ONE_ENTRY_AT_EQUAL):
        # The tile lies inside one cache block: one block-table entry.
        block = tl.load(block_table_ptr + start_n // BLOCK_SIZE).to(tl.int64)
        offs = block * stride_b + ((start_n % BLOCK_SIZE) + offs_n) * stride_t
    else:
        k_idx = start_n + offs_n
        if MASKED:
            block = tl.load(block_table_ptr + k_idx // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
        else:
            block = tl.load(block_table_ptr + k_idx // BLOCK_SIZE).to(tl.int64)
        offs = block * stride_b + (k_idx % BLOCK_SIZE) * stride_t
    return offs


@triton.jit
def softcap_log2(qk, CAP_LOG2: tl.constexpr):
    """Attention logit soft-capping (Gemma 2) on scores already in the exp2 domain: qk = s * log2(e)
    and CAP_LOG2 = cap * log2(e), so cap * tanh(s / cap) * log2(e) = CAP_LOG2 * tanh(qk / CAP_LOG2).
    tanh(x) = 2 * sigmoid(2x) - 1: fp32, and saturates to +-1 without overflow."""
    return CAP_LOG2 * (2.0 * tl.sigmoid(2.0 * qk / CAP_LOG2) - 1.0)


def softcap_constexpr(softcap) -> float:
    """The kernels' SOFTCAP_LOG2 constexpr: 0.0 (off) or cap * log2(e). A model's cap is a constant,
    so one compiled variant serves all its layers."""
    if softcap is None:
        return 0.0
    if not softcap > 0:
        raise ValueError(f"attention soft-cap must be positive, got {softcap}")
    return float(softcap) * LOG2E


@triton.jit
def round_to_e4m3(x):
    """x (fp32, |x| <= 448) rounded to the nearest E4M3 value, ties away from zero.

    For the interpreter only: Triton 3.x's interpreter converts fp32 to E4M3 wrongly when the
    rounding carries into the exponent (31.9 -> 16, not 32). Values already on the E4M3 grid
    convert exactly, so the interpreter's kernels round first. Compiled kernels use the
    hardware conversion (round to nearest even)."""
    ax = tl.abs(x)
    e = tl.maximum(tl.floor(tl.log2(tl.maximum(ax, 1e-30))), -6.0)  # -6: E4M3's smallest normal exponent
    step = tl.exp2(e - 3.0)  # 3 mantissa bits
    r = tl.floor(ax / step + 0.5) * step
    return tl.where(x < 0, -r, r)


@triton.jit
def load_kv_scales(scale_base, block_table_ptr, start_n, kv_ok, stride_sb, stride_st,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """The fp32 scales [BLOCK_N] of an FP8 key (or value) tile; 0 for keys where kv_ok is false."""
    offs = kv_tile_offsets(block_table_ptr, start_n, kv_ok, stride_sb, stride_st, BLOCK_SIZE, BLOCK_N, MASKED)
    if MASKED:
        return tl.load(scale_base + offs, mask=kv_ok, other=0.0)
    return tl.load(scale_base + offs)


def fp8_pair_views(k_cache: torch.Tensor, v_cache: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """int16 views of an FP8 cache (every stride half the byte stride) where its tiles are read as
    byte pairs (load_e4m3_pairs): compiled on sm_89+ (the pair conversion), a power-of-two head
    dim, byte strides that halve exactly; else None (bytewise loads)."""
    # ROOFLM_FP8_PAIRS=0: FP8 tiles loaded and widened a byte at a time (the benchmarks' A/B switch).
    if not envs.cached.ROOFLM_FP8_PAIRS or is_interpreter() or k_cache.device.type != "cuda":
        return None
    if _capability(k_cache.device.index if k_cache.device.index is not None else torch.cuda.current_device()) < (8, 9):
        return None
    head_dim = k_cache.shape[-1]
    if head_dim < 16 or head_dim != next_power_of_2(head_dim):
        return None
    if any(st % 2 for t in (k_cache, v_cache) for st in t.stride()[:-1]):
        return None
    return k_cache.view(torch.int16), v_cache.view(torch.int16)


@triton.jit
def load_e4m3_pairs(ptrs, row_ok, MASK_ROWS: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """An E4M3 tile [ROWS, COLS] widened to fp16, read through an int16 view of the cache (ptrs:
    [ROWS, COLS // 2] of byte pairs). Loaded bytewise, Triton turns an FP8 tile into one shared-memory
    load a byte plus its address arithmetic, and widens afterwards; as pairs, each 16-bit load
    feeds one cvt.rn.f16x2.e4m3x2 (sm_89+), two values an instruction. Compiled only (inline PTX)."""
    pairs = load_2d(ptrs, row_ok, row_ok, MASK_ROWS, False)
    lo, hi = tl.inline_asm_elementwise("{ .reg .b32 t; cvt.rn.f16x2.e4m3x2 t, $2; mov.b32 {$0, $1}, t; }",
                                       "=h,=h,h", [pairs], dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
    return tl.reshape(tl.join(lo, hi), [ROWS, COLS])  # byte 2j (the pair's low byte) is column 2j


@triton.jit
def fp8_pv(acc, p, v, vs_base, block_table_ptr, start_n, kv_ok, stride_sb, stride_st,
           BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + sum_n p_n s_n v_n for an FP8 value tile v (widened, unscaled) with scales s_n.

    The scales ride on p, normalised by the tile's largest scale so that p s_n / s_max stays in
    [0, 1] where fp16 is accurate (a V scale can be 1e-7); s_max multiplies the tile's product."""
    vs = load_kv_scales(vs_base, block_table_ptr, start_n, kv_ok, stride_sb, stride_st,
                        BLOCK_SIZE, BLOCK_N, MASKED)
    vs_max = tl.max(vs, 0)
    vs_max = tl.where(vs_max > 0, vs_max, 1.0)
    pv = tl.dot((p * (vs / vs_max)[None, :]).to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc + pv * vs_max


def config_for_head_dim(table: dict, head_dim_pad: int):
    """The tuned entry for this padded head dim, else the nearest larger one (small head dims,
    e.g. of test models, run fine with a larger head dim's tiles), else the largest."""
    if head_dim_pad in table:
        return table[head_dim_pad]
    larger = [d for d in table if d >= head_dim_pad]
    return table[min(larger)] if larger else table[max(table)]


def check_kv_scales(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: Optional[torch.Tensor],
                    v_scale: Optional[torch.Tensor]) -> None:
    """An FP8 cache comes with fp32 scales, [num_blocks, block_size, H_kv] per token or [H_kv]
    static (layers/kv_cache.py); any other cache with none."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) must share a dtype")
    if not fp8:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"scales are for FP8 caches; this cache is {k_cache.dtype}")
        return
    if k_scale is None or v_scale is None:
        raise ValueError("an FP8 (E4M3) cache needs k_scale and v_scale")
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t.dtype != torch.float32 or t.shape not in (k_cache.shape[:3], k_cache.shape[2:3]) or t.stride(-1) != 1:
            raise ValueError(f"{name} must be fp32 {tuple(k_cache.shape[:3])} (per token) or "
                             f"{tuple(k_cache.shape[2:3])} (static) with unit last stride, "
                             f"got {t.dtype} {tuple(t.shape)}")
    if k_scale.shape != v_scale.shape or k_scale.stride() != v_scale.stride():
        raise ValueError("k_scale and v_scale must share a shape and strides")


def check_paged_attention_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 meta, out: Optional[torch.Tensor], k_scale: Optional[torch.Tensor] = None,
                                 v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Checks shared by the paged attention wrappers; returns out (allocated when None).

    q [T, H, D]; k_cache, v_cache [num_blocks, block_size, H_kv, D] with equal strides, in q's
    dtype, or FP8 with their scales.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, kv_dim = k_cache.shape
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q must be fp16, bf16 or fp32, got {q.dtype}")
    check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    if k_cache.dtype != q.dtype and k_scale is None:
        raise TypeError(f"cache dtype ({k_cache.dtype}, {v_cache.dtype}) must match q ({q.dtype})")
    if v_cache.shape != k_cache.shape or kv_dim != head_dim:
        raise ValueError(f"cache shapes {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not match q {tuple(q.shape)}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if head_dim > 256:
        raise ValueError(f"head_dim up to 256 is supported, got {head_dim}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, t)
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache and v_cache must share strides, got {k_cache.stride()} and {v_cache.stride()}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must match q {tuple(q.shape)} {q.dtype}")
    check_last_dim_contiguous("out", out)
    if meta.block_tables.stride(-1) != 1:
        raise ValueError("block_tables must be contiguous in its last dimension")
    return out
